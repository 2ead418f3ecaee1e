// Calls one tool with the official TypeScript MCP SDK and prints one JSON line: the result
// (and what reading the first resource it links gives), or the error the SDK raised. The
// SDK validates structured content against the tool's output schema (listed first), even
// on errors, as strict desktop clients do.
//   node call_tool.mjs http <url> <tool> <arguments-json>
//   node call_tool.mjs stdio <command-json> <tool> <arguments-json>
import { Client } from "@modelcontextprotocol/sdk/client/index.js";
import { StdioClientTransport } from "@modelcontextprotocol/sdk/client/stdio.js";
import { StreamableHTTPClientTransport } from "@modelcontextprotocol/sdk/client/streamableHttp.js";

const [transportKind, target, tool, argsJson] = process.argv.slice(2);
let transport;
if (transportKind === "http") {
  transport = new StreamableHTTPClientTransport(new URL(target));
} else {
  const [command, ...args] = JSON.parse(target);
  transport = new StdioClientTransport({ command, args, env: process.env, stderr: "inherit" });
}
const client = new Client({ name: "kbmesh-ts-test", version: "1.0.0" });
await client.connect(transport);
let outcome;
try {
  await client.listTools();
  const result = await client.callTool({ name: tool, arguments: JSON.parse(argsJson) });
  const link = (result.content ?? []).find((item) => item.type === "resource_link");
  const linked = link ? await client.readResource({ uri: link.uri }) : null;
  outcome = { raised: null, result, linked };
} catch (err) {
  outcome = { raised: String(err?.message ?? err), result: null };
}
console.log(JSON.stringify(outcome));
await client.close();
