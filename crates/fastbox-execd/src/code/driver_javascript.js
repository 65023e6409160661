// fastbox-execd javascript and typescript code-context driver (embedded in execd, run with
// `node -e`; with the argument `typescript`, each cell is first transpiled by the sandbox's
// `typescript` package: types are removed, not checked).
// Reads one JSON request per line from stdin: {"code": str, "sentinel": str}. Runs the code
// in one persistent context (as the node REPL does: top-level `let`, `const`, `function` and
// `class` declarations stay for the next runs); the value of the last expression is the
// result (util.inspect of it; a promise is awaited first). A cell using top-level `await`
// runs as an async function. After each execution it writes
// `<sentinel> <json>` to stdout and `<sentinel>` to stderr so execd knows all output of that
// execution has been read. SIGINT interrupts a running execution.
'use strict';
const fs = require('fs');
const util = require('util');
const vm = require('vm');

const context = vm.createContext({
  console,
  process,
  require,
  Buffer,
  URL,
  URLSearchParams,
  TextEncoder,
  TextDecoder,
  setTimeout,
  clearTimeout,
  setInterval,
  clearInterval,
  setImmediate,
  clearImmediate,
  queueMicrotask,
  structuredClone,
  fetch: globalThis.fetch,
  module: { exports: {} },
  __filename: '<cell>',
  __dirname: process.cwd(),
});
context.global = context;
context.globalThis = context;

// The frames of the cell, not of this driver.
function cellFrames(stack) {
  const lines = String(stack).split('\n');
  const driver = lines.findIndex((l) => /\(node:vm:|\[eval\]|at (new )?Script[. ]/.test(l));
  return driver < 0 ? lines : lines.slice(0, driver);
}

const TYPESCRIPT = process.argv.slice(1).includes('typescript');
let typescript = null;

// The cell as javascript: itself, or its typescript transpiled.
function compiled(code) {
  if (!TYPESCRIPT) return code;
  if (typescript === null) {
    try {
      typescript = require('typescript');
    } catch (e) {
      const missing = new Error(
        'typescript contexts need the typescript package in the sandbox (the code-interpreter image has it)'
      );
      missing.name = 'ModuleNotFoundError';
      throw missing;
    }
  }
  const out = typescript.transpileModule(code, {
    compilerOptions: {
      target: typescript.ScriptTarget.ES2020,
      module: typescript.ModuleKind.None,
      noImplicitUseStrict: true,
    },
    reportDiagnostics: true,
  });
  if (out.diagnostics && out.diagnostics.length) {
    const text = out.diagnostics
      .map((d) => typescript.flattenDiagnosticMessageText(d.messageText, '\n'))
      .join('\n');
    throw new SyntaxError(text);
  }
  return out.outputText;
}

function errorOf(e) {
  if (e instanceof Error || (e && typeof e === 'object' && 'stack' in e)) {
    const stack = cellFrames(e.stack || `${e.name}: ${e.message}`);
    return { ename: String(e.name || 'Error'), evalue: String(e.message || ''), traceback: stack };
  }
  return { ename: 'Error', evalue: util.inspect(e), traceback: [`Uncaught ${util.inspect(e)}`] };
}

async function run(code, out) {
  try {
    let script;
    try {
      script = new vm.Script(compiled(code), { filename: '<cell>' });
    } catch (e) {
      // Top-level await: the cell runs as an async function (its declarations stay in it;
      // `return` gives the result).
      if (!(e instanceof SyntaxError) || !/await/.test(e.message)) throw e;
      script = new vm.Script(compiled(`(async () => {\n${code}\n})()`), { filename: '<cell>' });
    }
    let value = script.runInContext(context, { breakOnSigint: true, displayErrors: false });
    if (value && typeof value.then === 'function') {
      value = await value;
    }
    if (value !== undefined) {
      context._ = value;
      out.result = util.inspect(value, { depth: 4 });
    }
  } catch (e) {
    out.error = errorOf(e);
  }
}

function write(fd, text) {
  const bytes = Buffer.from(text);
  let at = 0;
  while (at < bytes.length) {
    try {
      at += fs.writeSync(fd, bytes, at);
    } catch (e) {
      if (e.code !== 'EAGAIN') throw e;
    }
  }
}

// Takes the context's environment and directory; returns why not, or null.
function adopt(given) {
  if (given.env && typeof given.env === 'object') {
    for (const key of Object.keys(process.env)) delete process.env[key];
    for (const [key, value] of Object.entries(given.env)) process.env[key] = String(value);
  }
  if (given.cwd) {
    try {
      process.chdir(String(given.cwd));
    } catch (e) {
      return `cwd ${given.cwd}: ${e.message}`;
    }
  }
  // `require` and `__dirname` resolve from the directory, as in an interpreter started there.
  const here = process.cwd();
  context.require = require('module').createRequire(require('path').join(here, '[eval]'));
  context.__dirname = here;
  return null;
}

async function main() {
  // SIGINT between executions is ignored; during one, `breakOnSigint` ends the script.
  process.on('SIGINT', () => {});
  const lines = require('readline').createInterface({ input: process.stdin, terminal: false });
  let count = 0;
  // One execution at a time, in order; the event loop runs between them (timers go on).
  for await (const line of lines) {
    let msg;
    try {
      msg = JSON.parse(line);
    } catch (e) {
      continue;
    }
    if (msg && typeof msg.adopt === 'object' && msg.adopt !== null) {
      // A warm interpreter handed to a new context: its environment and directory.
      const refused = adopt(msg.adopt);
      const sentinel = String(msg.sentinel || '');
      write(1, `${sentinel} ${JSON.stringify(refused ? { error: refused } : {})}\n`);
      write(2, `${sentinel}\n`);
      continue;
    }
    count += 1;
    const out = { execution_count: count };
    await run(String(msg.code || ''), out);
    // Let output written by timers of this execution that are already due go first.
    await new Promise((resolve) => setImmediate(resolve));
    const sentinel = String(msg.sentinel || '');
    write(1, `${sentinel} ${JSON.stringify(out)}\n`);
    write(2, `${sentinel}\n`);
  }
}

main().catch((e) => {
  write(2, `driver failed: ${e && e.stack}\n`);
  process.exit(1);
});
