"""What the web tier runs: admission, publishing a request and awaiting its reply, the HTTP API, monitoring read-outs."""
