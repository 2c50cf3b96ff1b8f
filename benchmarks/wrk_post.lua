-- wrk script for benchmarks/overhead.py: POSTs one JSON body per request, drawn at random from a file.
--   WRK_BODIES=<file, one JSON body per line> WRK_TOKEN=<API token, optional> wrk ... -s benchmarks/wrk_post.lua URL
-- Counts responses by status in every thread and prints one machine-readable line at the end:
--   OVERHEAD_JSON {"requests":..,"duration_us":..,"statuses":{"200":..},"errors":{..},"latency_us":{"p50":..}}

local threads = {}

function setup(thread)
  table.insert(threads, thread)
end

function init(args)
  statuses = {}
  local path = wrk.path
  local headers = {["Content-Type"] = "application/json"}
  local token = os.getenv("WRK_TOKEN")
  if token and token ~= "" then
    headers["Authorization"] = "Token " .. token
  end
  reqs = {}
  for line in io.lines(os.getenv("WRK_BODIES")) do
    if line ~= "" then
      table.insert(reqs, wrk.format("POST", path, headers, line))
    end
  end
  math.randomseed(os.time() + #threads)
end

function request()
  return reqs[math.random(#reqs)]
end

function response(status, headers, body)
  statuses[status] = (statuses[status] or 0) + 1
end

function done(summary, latency, requests)
  local counts = {}
  for _, thread in ipairs(threads) do
    for status, n in pairs(thread:get("statuses")) do
      counts[status] = (counts[status] or 0) + n
    end
  end
  local parts = {}
  for status, n in pairs(counts) do
    table.insert(parts, string.format('"%d":%d', status, n))
  end
  local e = summary.errors
  local p = {}
  for _, q in ipairs({50, 90, 99}) do
    table.insert(p, string.format('"p%d":%d', q, latency:percentile(q)))
  end
  io.write(string.format(
    'OVERHEAD_JSON {"requests":%d,"duration_us":%d,"statuses":{%s},' ..
    '"errors":{"connect":%d,"read":%d,"write":%d,"timeout":%d},"latency_us":{%s,"mean":%.1f,"max":%d}}\n',
    summary.requests, summary.duration, table.concat(parts, ","),
    e.connect, e.read, e.write, e.timeout, table.concat(p, ","), latency.mean, latency.max))
end
