// The console's router: #/kbs, #/kbs/new, #/kbs/<id>/<tab>, #/dead-letters.
import { apiKey } from "./api.js";
import { clear, h } from "./dom.js";
import { renderDeadLetters } from "./deadletters.js";
import { renderKb } from "./kb.js";
import { renderKbNew } from "./kbform.js";
import { renderKbList } from "./kbs.js";
import { beginSignIn, completeSignIn, session, signInConfig, who } from "./signin.js";
import { toast } from "./ui.js";

const main = document.getElementById("main");
let cleanup = null;

const routes = [
  [/^#\/kbs\/?$/, "kbs", () => renderKbList],
  [/^#\/kbs\/new$/, "kbs", () => renderKbNew],
  [/^#\/kbs\/([^/]+)(?:\/(overview|documents|search|sources|settings))?$/, "kbs", () => renderKb],
  [/^#\/dead-letters$/, "dead-letters", () => renderDeadLetters],
];

async function route() {
  if (cleanup) {
    cleanup();
    cleanup = null;
  }
  const hash = location.hash || "#/kbs";
  for (const [re, nav, page] of routes) {
    const m = re.exec(hash);
    if (!m) continue;
    for (const a of document.querySelectorAll("[data-nav]")) {
      if (a.dataset.nav === nav) a.setAttribute("aria-current", "page");
      else a.removeAttribute("aria-current");
    }
    const params = m.slice(1).map((p) => (p === undefined ? undefined : decodeURIComponent(p)));
    const token = {};
    current = token;
    const done = await page()(main, ...params);
    if (current === token) cleanup = typeof done === "function" ? done : null;
    else if (typeof done === "function") done();
    return;
  }
  location.replace("#/kbs");
}
let current = null;

export function navigate(hash) {
  if (location.hash === hash) route();
  else location.hash = hash;
}

function renderKeySlot() {
  const slot = clear(document.getElementById("keyslot"));
  const signedIn = session.get();
  if (signedIn) {
    slot.append(
      h("span.keystate", `Signed in as ${who(signedIn.user)}`),
      h("button.btn.btn-small.btn-ghost", {
        type: "button",
        onclick: () => {
          session.clear();
          renderKeySlot();
          route();
        },
      }, "Sign out"),
    );
  } else if (apiKey.get()) {
    slot.append(
      h("span.keystate", "API key set"),
      h("button.btn.btn-small.btn-ghost", {
        type: "button",
        onclick: () => {
          apiKey.set("");
          renderKeySlot();
          route();
        },
      }, "Forget key"),
    );
  }
}

async function askForKey(message) {
  const bar = document.getElementById("keybar");
  if (!bar.hidden) return;
  const provider = await signInConfig();
  const input = h("input#api-key", { type: "password", autocomplete: "off", required: true, placeholder: "kbm_…", "aria-describedby": "api-key-error" });
  const error = h("p.field-error#api-key-error", { role: "alert", hidden: true });
  bar.hidden = false;
  clear(bar).append(
    h(
      "form.keyform",
      {
        onsubmit: async (e) => {
          e.preventDefault();
          const key = input.value.trim();
          // Tried before it is kept: a key the server refuses is said so here, not "saved".
          const refused = await refusal(key);
          if (refused) {
            error.textContent = refused;
            error.hidden = false;
            input.setAttribute("aria-invalid", "true");
            input.focus();
            return;
          }
          apiKey.set(key);
          bar.hidden = true;
          renderKeySlot();
          toast("API key accepted; kept for this browser tab");
          route();
        },
      },
      provider
        ? [
          h("p", h("strong", "Sign in to use this server. "), message || ""),
          h("div.keyform-row",
            h("button.btn.btn-primary", {
              type: "button",
              onclick: () => beginSignIn().catch((err) => toast(`Sign-in failed: ${err.message}`, "error")),
            }, `Sign in with ${new URL(provider.issuer).host}`)),
          h("p.help", "Or use an API key:"),
        ]
        : h("p", h("strong", "This server needs an API key. "), message || ""),
      h("div.keyform-row",
        h("label", { for: "api-key" }, "API key"),
        input,
        h("button.btn.btn-primary", { type: "submit" }, "Use key")),
      h("p.help", "Kept in this tab's session storage only and sent as a bearer token."),
      error,
    ),
  );
  input.focus();
}

/** Why the server refuses `key` (null: it is accepted). */
async function refusal(key) {
  try {
    const r = await fetch("/v1/kbs?limit=1", {
      headers: { Accept: "application/json", Authorization: `Bearer ${key}` },
    });
    if (r.status !== 401 && r.status !== 403) return null;
    const body = await r.json().catch(() => ({}));
    return `This key was refused: ${body.detail || `HTTP ${r.status}`}`;
  } catch (err) {
    return `The server cannot be reached (${err.message}).`;
  }
}

// "Skip to content" moves the focus to the page's content; following its #main link would
// be read as a route and leave the page.
document.querySelector(".skip-link").addEventListener("click", (e) => {
  e.preventDefault();
  const main = document.getElementById("main");
  main.setAttribute("tabindex", "-1");
  main.focus();
});

window.addEventListener("kbmesh:unauthorized", (e) => {
  // A sign-in that ended, or a key that was refused, says why; without either the request
  // is enough.
  if (session.get()) {
    session.clear();
    renderKeySlot();
    askForKey(`Your sign-in has ended (${e.detail ? e.detail.message : "refused"}).`);
  } else {
    askForKey(apiKey.get() && e.detail ? `The key in use was refused: ${e.detail.message}.` : "");
  }
});
window.addEventListener("hashchange", route);

async function start() {
  try {
    const user = await completeSignIn();
    if (user) toast(`Signed in as ${who(user)}`);
  } catch (err) {
    toast(`Sign-in failed: ${err.message}`, "error");
  }
  renderKeySlot();
  route();
}
start();
