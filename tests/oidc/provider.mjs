// A real OpenID provider (panva/oidc-provider) for kbmesh's resource-server tests, on loopback.
// Usage: node provider.mjs <port> <issuer> ; prints "ready" once it listens.
// Issues JWT access tokens (RFC 9068) for whatever resource a client names (RFC 8707), with
// the scopes kb:read kb:write kb:admin; kbmesh itself decides whether the audience is its own.
// Accounts: any login name; its claims (org, kbs, name, e-mail) are read from the JSON file
// named by ACCOUNTS_FILE at each token, so a test may limit a user to KBs it created.
// Clients: "kbmesh-test" (tokens live 10 min) and "kbmesh-short" (tokens live 1 s); with
// CONSOLE_URL set, "kbmesh-people": the public client people sign in as, from the console at
// that URL (code + PKCE, its token endpoint open to the console's origin) and from `kbmesh
// login` (the device grant, RFC 8628).
import { generateKeyPairSync, randomUUID } from "node:crypto";
import { readFileSync } from "node:fs";
import Provider from "oidc-provider";

const [port, issuer] = process.argv.slice(2);
const accounts = () => JSON.parse(readFileSync(process.env.ACCOUNTS_FILE, "utf8"));
const REDIRECT = "http://127.0.0.1:1/callback";
const signing = generateKeyPairSync("rsa", { modulusLength: 2048 }).privateKey.export({ format: "jwk" });
const client = (id) => ({
  client_id: id,
  token_endpoint_auth_method: "none",
  redirect_uris: [REDIRECT],
  grant_types: ["authorization_code", "refresh_token"],
  response_types: ["code"],
  scope: "openid offline_access kb:read kb:write kb:admin",
});

const people = process.env.CONSOLE_URL && {
  ...client("kbmesh-people"),
  redirect_uris: [process.env.CONSOLE_URL],
  grant_types: ["authorization_code", "refresh_token", "urn:ietf:params:oauth:grant-type:device_code"],
  scope: "openid profile email offline_access kb:read kb:write kb:admin",
};

const provider = new Provider(issuer, {
  clients: [client("kbmesh-test"), client("kbmesh-short"), ...(people ? [people] : [])],
  // A public client's token endpoint answers pages served from its redirect URIs' origins.
  clientBasedCORS: (ctx, origin, client) =>
    client.clientAuthMethod === "none" && client.redirectUris.some((uri) => new URL(uri).origin === origin),
  // Name and e-mail in the ID token itself, where the console reads who signed in.
  conformIdTokenClaims: false,
  jwks: { keys: [{ ...signing, kid: randomUUID(), use: "sig", alg: "RS256" }] },
  scopes: ["openid", "offline_access", "kb:read", "kb:write", "kb:admin"],
  claims: { openid: ["sub"], email: ["email"], profile: ["name"] },
  pkce: { required: () => true },
  findAccount: (ctx, sub) => ({ accountId: sub, claims: () => ({ sub, ...(accounts()[sub] || {}) }) }),
  features: {
    devInteractions: { enabled: true },
    deviceFlow: { enabled: true },
    registration: { enabled: true },
    resourceIndicators: {
      enabled: true,
      defaultResource: () => undefined,
      useGrantedResource: () => true,
      getResourceServerInfo: (ctx, resource, client) => ({
        scope: "kb:read kb:write kb:admin",
        audience: resource,
        accessTokenFormat: "jwt",
        accessTokenTTL: client.clientId === "kbmesh-short" ? 1 : 600,
        jwt: { sign: { alg: "RS256" } },
      }),
    },
  },
  // The user's org, KBs, name and e-mail ride in the access token, where kbmesh reads them.
  extraTokenClaims: (ctx, token) => {
    return accounts()[token.accountId] || {};
  },
});
provider.listen(Number(port), "127.0.0.1", () => console.log("ready"));
