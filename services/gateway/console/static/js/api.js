// The public REST API, and nothing else. The bearer token is the signed-in person's access
// token (signin.js), else a key typed by the user; both live in sessionStorage (this tab
// only); a 401 asks for one.
import { session } from "./signin.js";

const KEY = "kbmesh.apiKey";

export class ApiError extends Error {
  constructor(status, body) {
    const detail = (body && (body.detail || body.message)) || `HTTP ${status}`;
    super(typeof detail === "string" ? detail : JSON.stringify(detail));
    this.status = status;
    this.body = body || {};
    this.field = this.body.field || null;
  }

  /** {field: message} for every error that names a field. */
  fieldErrors() {
    const out = {};
    for (const e of this.body.errors || []) {
      if (e.field) out[e.field.split(".").pop()] = e.message;
    }
    if (this.field && !out[this.field]) out[this.field] = this.message;
    return out;
  }
}

export const apiKey = {
  get: () => sessionStorage.getItem(KEY) || "",
  set(value) {
    if (value) sessionStorage.setItem(KEY, value);
    else sessionStorage.removeItem(KEY);
  },
};

export function headers(json) {
  const out = { Accept: "application/json" };
  if (json) out["Content-Type"] = "application/json";
  const key = session.get()?.access_token || apiKey.get();
  if (key) out.Authorization = `Bearer ${key}`;
  return out;
}

async function parse(response) {
  const text = await response.text();
  if (!text) return null;
  try {
    return JSON.parse(text);
  } catch {
    return { detail: text };
  }
}

function failed(status, body) {
  const err = new ApiError(status, body);
  if (status === 401) window.dispatchEvent(new CustomEvent("kbmesh:unauthorized", { detail: err }));
  return err;
}

export async function api(method, path, body) {
  let response;
  try {
    response = await fetch(path, {
      method,
      headers: headers(body !== undefined),
      body: body === undefined ? undefined : JSON.stringify(body),
    });
  } catch (err) {
    throw new ApiError(0, { detail: `The server cannot be reached (${err.message}).` });
  }
  const data = await parse(response);
  if (!response.ok) throw failed(response.status, data);
  return data;
}

export function query(params) {
  const q = new URLSearchParams();
  for (const [k, v] of Object.entries(params)) {
    if (v !== undefined && v !== null && v !== "") q.set(k, String(v));
  }
  const s = q.toString();
  return s ? `?${s}` : "";
}

/**
 * POST a FormData (a file and its fields) with upload progress (fetch has none):
 * onProgress(fraction) while bytes go out. The browser sets the multipart Content-Type.
 */
export function upload(path, form, onProgress) {
  return new Promise((resolve, reject) => {
    const xhr = new XMLHttpRequest();
    xhr.open("POST", path);
    for (const [k, v] of Object.entries(headers(false))) xhr.setRequestHeader(k, v);
    xhr.upload.addEventListener("progress", (e) => {
      if (e.lengthComputable) onProgress(e.loaded / e.total);
    });
    xhr.upload.addEventListener("load", () => onProgress(1));
    xhr.addEventListener("load", () => {
      let data = null;
      try {
        data = xhr.responseText ? JSON.parse(xhr.responseText) : null;
      } catch {
        data = { detail: xhr.responseText };
      }
      if (xhr.status >= 200 && xhr.status < 300) resolve(data);
      else reject(failed(xhr.status, data));
    });
    xhr.addEventListener("error", () => reject(new ApiError(0, { detail: "network error" })));
    xhr.send(form);
  });
}

/** All items of a paginated list endpoint (the console sorts and filters KBs itself). */
export async function all(path, params = {}, pageSize = 200) {
  const items = [];
  for (let skip = 0; ; skip += pageSize) {
    const page = await api("GET", path + query({ ...params, skip, limit: pageSize }));
    items.push(...page.items);
    if (items.length >= page.total || page.items.length === 0) return items;
  }
}

/**
 * Server-sent events read with fetch (EventSource cannot send the API key). Calls
 * onEvent(type, data) per event; resolves false when the stream cannot be opened.
 * Returns {opened: Promise<boolean>, close()}.
 */
export function events(path, onEvent) {
  const abort = new AbortController();
  const opened = (async () => {
    let response;
    try {
      response = await fetch(path, { headers: { ...headers(false), Accept: "text/event-stream" }, signal: abort.signal });
    } catch {
      return false;
    }
    if (!response.ok || !response.body) return false;
    (async () => {
      const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
      let buffer = "";
      try {
        for (;;) {
          const { value, done } = await reader.read();
          if (done) break;
          buffer += value;
          let end;
          while ((end = buffer.search(/\r?\n\r?\n/)) >= 0) {
            const block = buffer.slice(0, end);
            buffer = buffer.slice(end).replace(/^\r?\n\r?\n/, "");
            let type = "message";
            const data = [];
            for (const line of block.split(/\r?\n/)) {
              if (line.startsWith("event:")) type = line.slice(6).trim();
              else if (line.startsWith("data:")) data.push(line.slice(5).replace(/^ /, ""));
            }
            if (data.length) {
              let parsed = data.join("\n");
              try {
                parsed = JSON.parse(parsed);
              } catch {
                // plain text data
              }
              onEvent(type, parsed);
            }
          }
        }
      } catch {
        // aborted, or the connection dropped: the page falls back to polling
      }
      onEvent("closed", null);
    })();
    return true;
  })();
  return { opened, close: () => abort.abort() };
}
