#!/usr/bin/env node
// Validates rendered Kubernetes objects (a JSON array, file argument or stdin) against their schemas.
//
// Two passes over the same generated models (kubernetes-models: Kubernetes' OpenAPI; @kubernetes-models/keda
// and /prometheus-operator: the CRDs' openAPIV3Schema):
//   1. values: each object's JSON-schema validator (types, required fields, enums, formats);
//   2. field names: the objects as TypeScript literals of the models' interfaces, type-checked, so a field
//      the schema does not know ("livenessProbes", "minReplicas") is an error, as `kubeconform -strict`
//      would have it. The schemas themselves allow unknown fields, as the API server's pruning does; a
//      misspelt field would then be dropped silently on apply.
// An object whose apiVersion/kind has no schema here is an error, never skipped.
// Prints one line per problem and exits 1, or prints "valid: N objects" and exits 0.
"use strict";

const fs = require("fs");
const path = require("path");
const ts = require("typescript");

function modulePath(apiVersion, kind) {
  const [group, version] = apiVersion.includes("/") ? apiVersion.split("/") : ["", apiVersion];
  if (group === "keda.sh") return `@kubernetes-models/keda/keda.sh/${version}/${kind}`;
  if (group === "monitoring.coreos.com") {
    return `@kubernetes-models/prometheus-operator/monitoring.coreos.com/${version}/${kind}`;
  }
  return group ? `kubernetes-models/${group}/${version}/${kind}` : `kubernetes-models/${version}/${kind}`;
}

function label(obj) {
  return `${obj.kind}/${(obj.metadata && obj.metadata.name) || "<no name>"}`;
}

function validateValues(objects, problems) {
  const typed = [];
  objects.forEach((obj, index) => {
    if (!obj || typeof obj.apiVersion !== "string" || typeof obj.kind !== "string") {
      problems.push(`object ${index}: no apiVersion/kind`);
      return;
    }
    const mod = modulePath(obj.apiVersion, obj.kind);
    let Model;
    try {
      Model = require(mod)[obj.kind];
    } catch (err) {
      Model = undefined;
    }
    if (!Model) {
      problems.push(`${label(obj)}: no schema for ${obj.apiVersion} ${obj.kind}`);
      return;
    }
    try {
      new Model(obj).validate();
    } catch (err) {
      problems.push(`${label(obj)}: ${err.message}`);
    }
    typed.push({ obj, mod });
  });
  return typed;
}

function validateFieldNames(typed, problems) {
  if (typed.length === 0) return;
  const file = path.join(__dirname, "__rendered__.ts");
  const lines = [];
  typed.forEach(({ obj, mod }, i) => lines.push(`import type { I${obj.kind} as T${i} } from ${JSON.stringify(mod)};`));
  const starts = [];
  typed.forEach(({ obj }, i) => {
    starts.push(lines.length);
    lines.push(...`export const o${i}: T${i} = ${JSON.stringify(obj, null, 1)};`.split("\n"));
  });
  const source = lines.join("\n");

  const options = {
    strict: true,
    noEmit: true,
    skipLibCheck: true,
    target: ts.ScriptTarget.ES2020,
    module: ts.ModuleKind.CommonJS,
    moduleResolution: ts.ModuleResolutionKind.Node10,
    types: [],
  };
  const host = ts.createCompilerHost(options);
  const getSourceFile = host.getSourceFile.bind(host);
  host.getSourceFile = (name, target, ...rest) =>
    path.resolve(name) === file ? ts.createSourceFile(name, source, target) : getSourceFile(name, target, ...rest);
  const fileExists = host.fileExists.bind(host);
  host.fileExists = (name) => path.resolve(name) === file || fileExists(name);
  const readFile = host.readFile.bind(host);
  host.readFile = (name) => (path.resolve(name) === file ? source : readFile(name));

  const program = ts.createProgram({ rootNames: [file], options, host });
  for (const diagnostic of ts.getPreEmitDiagnostics(program)) {
    const message = ts.flattenDiagnosticMessageText(diagnostic.messageText, " ");
    if (!diagnostic.file || path.resolve(diagnostic.file.fileName) !== file) {
      problems.push(`type check: ${message}`);
      continue;
    }
    const { line } = diagnostic.file.getLineAndCharacterOfPosition(diagnostic.start);
    let index = starts.length - 1;
    while (index > 0 && starts[index] > line) index--;
    const where = line < starts[0] ? "imports" : label(typed[index].obj);
    problems.push(`${where}: ${message} (line: ${lines[line].trim()})`);
  }
}

function main() {
  const input = fs.readFileSync(process.argv[2] || 0, "utf8");
  const objects = JSON.parse(input);
  if (!Array.isArray(objects)) throw new Error("expected a JSON array of objects");
  const problems = [];
  const typed = validateValues(objects, problems);
  validateFieldNames(typed, problems);
  if (problems.length) {
    for (const problem of problems) console.log(problem);
    process.exit(1);
  }
  console.log(`valid: ${objects.length} objects`);
}

main();
