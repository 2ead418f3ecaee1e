// Signing a person in with the identity provider that /v1/sign-in names: authorization code
// with PKCE (S256) in this page, the provider sending the person back to "/", the code
// exchanged at its token endpoint (which answers this origin: CORS for a public client).
// The access token lives in sessionStorage (this tab only), like a typed API key; no refresh
// token is asked for: when the token ends, signing in again is one redirect.

const SESSION = "kbmesh.session"; // {access_token, user: {sub, name, email}}
const PENDING = "kbmesh.signin"; // what the return from the provider is checked against

let config;

/** The provider and client to sign in with, or null (API keys only). */
export async function signInConfig() {
  if (config === undefined) {
    try {
      const r = await fetch("/v1/sign-in", { headers: { Accept: "application/json" } });
      config = r.ok ? await r.json() : {};
    } catch {
      config = {};
    }
  }
  return config.issuer && config.client_id ? config : null;
}

export const session = {
  get() {
    try {
      return JSON.parse(sessionStorage.getItem(SESSION) || "null");
    } catch {
      return null;
    }
  },
  clear: () => sessionStorage.removeItem(SESSION),
};

/** Who is signed in, in words. */
export function who(user) {
  if (user.name && user.email) return `${user.name} <${user.email}>`;
  return user.name || user.email || user.sub;
}

function base64url(bytes) {
  return btoa(String.fromCharCode(...new Uint8Array(bytes)))
    .replace(/\+/g, "-").replace(/\//g, "_").replace(/=+$/, "");
}

const random = () => base64url(crypto.getRandomValues(new Uint8Array(32)));
const redirectUri = () => `${location.origin}/`;

async function discover(issuer) {
  const r = await fetch(`${issuer.replace(/\/$/, "")}/.well-known/openid-configuration`);
  if (!r.ok) throw new Error(`the identity provider answered HTTP ${r.status}`);
  return r.json();
}

/** Off to the provider's sign-in page; the console's place (#/…) is kept for the return. */
export async function beginSignIn() {
  const cfg = await signInConfig();
  const provider = await discover(cfg.issuer);
  const verifier = random();
  const state = random();
  const nonce = random();
  const challenge = base64url(await crypto.subtle.digest("SHA-256", new TextEncoder().encode(verifier)));
  sessionStorage.setItem(PENDING, JSON.stringify({
    state, verifier, nonce, hash: location.hash, tokenEndpoint: provider.token_endpoint,
  }));
  const q = new URLSearchParams({
    response_type: "code",
    client_id: cfg.client_id,
    redirect_uri: redirectUri(),
    scope: cfg.scopes.filter((s) => s !== "offline_access").join(" "),
    state,
    nonce,
    code_challenge: challenge,
    code_challenge_method: "S256",
  });
  if (cfg.resource) q.set("resource", cfg.resource);
  location.assign(`${provider.authorization_endpoint}?${q}`);
}

function idClaims(idToken) {
  const part = (idToken || "").split(".")[1] || "";
  const b64 = part.replace(/-/g, "+").replace(/_/g, "/");
  const bytes = Uint8Array.from(atob(b64), (c) => c.charCodeAt(0));
  return JSON.parse(new TextDecoder().decode(bytes));
}

/**
 * The return from the provider (/?code=…&state=…): the code exchanged for a token and the
 * person kept. Resolves to the user, or null when this page load is no such return; throws
 * an Error saying why a sign-in failed.
 */
export async function completeSignIn() {
  const params = new URLSearchParams(location.search);
  if (!params.has("state")) return null;
  const pending = JSON.parse(sessionStorage.getItem(PENDING) || "null");
  sessionStorage.removeItem(PENDING);
  // The code leaves the address bar (and history) at once.
  history.replaceState(null, "", `/${(pending && pending.hash) || ""}`);
  const cfg = await signInConfig();
  if (!pending || !cfg || params.get("state") !== pending.state) {
    throw new Error("this sign-in was not started in this tab; sign in again");
  }
  if (params.has("error")) throw new Error(params.get("error_description") || params.get("error"));
  // RFC 9207: the answer names who sent it, so another provider's code is not sent here.
  if (params.has("iss") && params.get("iss") !== cfg.issuer) {
    throw new Error("the sign-in came back from another identity provider");
  }
  const body = new URLSearchParams({
    grant_type: "authorization_code",
    code: params.get("code") || "",
    redirect_uri: redirectUri(),
    client_id: cfg.client_id,
    code_verifier: pending.verifier,
  });
  if (cfg.resource) body.set("resource", cfg.resource);
  let r;
  try {
    r = await fetch(pending.tokenEndpoint, { method: "POST", headers: { Accept: "application/json" }, body });
  } catch (err) {
    throw new Error(`the identity provider cannot be reached (${err.message})`);
  }
  const answer = await r.json().catch(() => ({}));
  if (!r.ok) throw new Error(answer.error_description || answer.error || `HTTP ${r.status}`);
  // Straight from the token endpoint, so its signature need not be checked here (OpenID
  // Connect Core §3.1.3.7); the nonce ties it to this sign-in.
  const claims = idClaims(answer.id_token);
  if (claims.nonce !== pending.nonce) throw new Error("the sign-in answered another request; sign in again");
  const user = { sub: claims.sub, name: claims.name || null, email: claims.email || null };
  sessionStorage.setItem(SESSION, JSON.stringify({ access_token: answer.access_token, user }));
  return user;
}
