// The page's client: a multi-turn chat over POST /v1/chat/completions (stream: true, fetch + ReadableStream
// SSE parsing), drawing each `dgemma_draft` event as the current block's canvas. It uses only the public API,
// so it is also a reference client. What the stream brings is played in order at a readable pace (each step's
// canvas on screen at least PACE_MS, as `dgemma watch` does on a terminal; the Pace box turns it off), each
// block's last canvas stays (folded) with a replay, the view follows new output only while it is scrolled to
// the end. "New chat" empties the history and the transcript. Must not: know server internals or hold state
// beyond this tab (the API key lives in sessionStorage).
"use strict";

const $ = (id) => document.getElementById(id);
const KEY = "dgemma-api-key";
const ENTROPY_EDGES = [1e-1, 1e-2, 1e-3]; // nats, as `dgemma watch`: below edge i is at least level i + 1
const PACE_MS = 150; // `dgemma watch`'s DEFAULT_PACE_S: the bundled model's steps take ms, too fast to see
const history = []; // {role, content}: the turns that completed (a stopped or failed one is left out)
let running = null; // the AbortController of the request in flight
let conversation = 0; // counts "New chat"s: a request started before one must not add to the new history

function headers() {
  const h = {"Content-Type": "application/json"};
  const key = sessionStorage.getItem(KEY);
  if (key) h.Authorization = "Bearer " + key;
  return h;
}

async function errorOf(response) {
  // OpenAI's error object; any other body is shown as its status.
  try { return (await response.json()).error; } catch (e) { return {message: `HTTP ${response.status}`}; }
}

function inForm(error) {
  // The server names its API fields (max_denoising_steps); the form's labels are what the user sees.
  let message = error.message || String(error);
  for (const input of document.querySelectorAll(".fields [name]")) {
    const label = input.closest("label").firstChild.textContent.trim();
    message = message.replace(new RegExp(`\\b${input.name}\\b`, "g"), `“${label}”`);
    if (error.param === input.name) input.setAttribute("aria-invalid", "true");
  }
  return message;
}

// The view follows new output while it is at the end of the page; a user who scrolls up (to read, or to reach
// New chat) stops that until they scroll back down. Output never moves what the user is about to click.
let follow = true;
function atEnd() {
  const page = document.scrollingElement;
  return page.scrollHeight - page.scrollTop - page.clientHeight <= 2;
}
function toEnd() { window.scrollTo(0, document.scrollingElement.scrollHeight); }
window.addEventListener("scroll", () => { follow = atEnd(); }, {passive: true});

function el(tag, cls, text) {
  const e = document.createElement(tag);
  if (cls) e.className = cls;
  if (text !== undefined) e.textContent = text;
  return e;
}

// ---- the API key -------------------------------------------------------------------------------------------

async function checkKey() {
  // /v1/models answers 401 exactly when the key is wrong or missing: ask for one then.
  let response;
  try { response = await fetch("/v1/models", {headers: headers()}); } catch (e) { setStatus("server unreachable"); return false; }
  if (response.status === 401) {
    const had = sessionStorage.getItem(KEY) !== null;
    sessionStorage.removeItem(KEY);
    askKey(had ? (await errorOf(response)).message : "");
    return false;
  }
  if (response.ok) {
    const models = await response.json();
    $("model").textContent = models.data.length ? models.data[0].id : "";
    $("key-form").hidden = true;
  }
  return response.ok;
}

function askKey(message) {
  $("key-form").hidden = false;
  $("key-error").textContent = message;
  $("key").focus();
}

$("key-form").addEventListener("submit", async (event) => {
  event.preventDefault();
  sessionStorage.setItem(KEY, $("key").value);
  $("key").value = "";
  if (await checkKey()) $("prompt").focus();
});

// ---- a request ---------------------------------------------------------------------------------------------

function settings() {
  // Only the fields the user filled: the server's settings are the base a request changes.
  const body = {};
  for (const id of ["steps", "entropy_bound", "t_min", "t_max", "seed", "blocks"]) {
    const input = $(id);
    if (input.value.trim() !== "") body[input.name] = Number(input.value);
  }
  const thinking = $("thinking").value;
  if (thinking) body.chat_template_kwargs = {enable_thinking: thinking === "on"};
  return body;
}

function setStatus(text) { $("status").textContent = text; }

function setRunning(controller) {
  running = controller;
  $("send").disabled = controller !== null;
  $("stop").disabled = controller === null;
}

// The attached images as OpenAI image_url parts (data URLs), then the text: one user turn's content.
async function contentOf(prompt) {
  const files = [...$("image").files];
  if (!files.length) return prompt;
  const urls = await Promise.all(files.map((f) => new Promise((done, fail) => {
    const reader = new FileReader();
    reader.onload = () => done(reader.result);
    reader.onerror = () => fail(reader.error);
    reader.readAsDataURL(f);
  })));
  return [...urls.map((url) => ({type: "image_url", image_url: {url}})), {type: "text", text: prompt}];
}

async function send() {
  const prompt = $("prompt").value;
  if (running || !prompt.trim()) return;
  $("prompt").value = ""; // the prompt moves to the transcript; it comes back unless the turn completes
  const started = conversation;
  const content = await contentOf(prompt);
  const messages = [...history, {role: "user", content}];
  const turn = new Turn(prompt);
  const controller = new AbortController();
  setRunning(controller);
  setStatus("generating…");
  let outcome = "error";
  try {
    const response = await fetch("/v1/chat/completions", {
      method: "POST", headers: headers(), signal: controller.signal,
      body: JSON.stringify({messages, stream: true, stream_options: {include_drafts: true, include_usage: true},
                            ...settings()}),
    });
    if (!response.ok) {
      turn.fail(inForm(await errorOf(response)));
      if (response.status === 401) { sessionStorage.removeItem(KEY); askKey(""); }
    } else {
      outcome = await readStream(response, turn);
      if (outcome === "done") { await turn.played(controller.signal); turn.finish(); } // Stop: all of it at once
    }
  } catch (e) {
    if (e.name === "AbortError") { turn.stop(); outcome = "stopped"; } else turn.fail(String(e.message || e));
  }
  if (started !== conversation) return; // "New chat" stopped it and cleared the page
  if (outcome === "done") {
    history.push({role: "user", content}, {role: "assistant", content: turn.content});
    $("image").value = ""; // sent with its turn (and kept in the history)
  }
  // A failed or stopped turn is not context: give its prompt back to edit or resend, unless a new one is typed.
  else if ($("prompt").value === "") $("prompt").value = prompt;
  setRunning(null);
  setStatus(outcome === "done" ? "" : outcome);
}

function newChat() {
  // Every request carries the whole history; this starts over with none (stopping a request in flight).
  conversation += 1;
  if (running) running.abort();
  setRunning(null);
  history.length = 0;
  $("log").replaceChildren();
  setStatus("");
  $("prompt").focus();
}

async function readStream(response, turn) {
  // SSE: events are separated by a blank line; each of ours is one `data:` line.
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const {done, value} = await reader.read();
    if (done) break;
    buffer += decoder.decode(value, {stream: true});
    let cut;
    while ((cut = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, cut);
      buffer = buffer.slice(cut + 2);
      for (const line of event.split("\n")) {
        if (!line.startsWith("data:")) continue;
        const data = line.slice(5).trim();
        if (data === "[DONE]") return "done"; // the turn ends once all of it is on screen (send)
        const chunk = JSON.parse(data);
        if (chunk.error) { turn.fail(inForm(chunk.error)); return "error"; }
        turn.chunk(chunk);
      }
    }
  }
  turn.fail("the stream ended early");
  return "error";
}

// ---- one exchange on the page ------------------------------------------------------------------------------

class Turn {
  constructor(prompt) {
    const log = $("log");
    log.append(el("li", "user", prompt));
    this.li = el("li", "assistant");
    this.li.dataset.state = "running";
    this.reasoning = el("details", "reasoning");
    this.reasoning.append(el("summary", "", "Thinking"));
    this.reasoningText = el("div", "text");
    this.reasoning.append(this.reasoningText);
    this.reasoning.hidden = true;
    this.answer = el("div", "answer text");
    this.canvas = el("div", "canvas");
    this.canvas.setAttribute("aria-label", "Current block, denoising");
    this.canvas.setAttribute("role", "img");
    this.label = el("div", "canvas-label muted");
    this.blocks = el("ol", "blocks");
    this.blocks.setAttribute("aria-label", "Blocks");
    this.li.append(this.reasoning, this.answer, this.label, this.canvas, this.blocks);
    log.append(this.li);
    this.content = "";
    this.frames = []; // the current block's drafts as drawn (its replay)
    this.clock = performance.now(); // the current block's start, as this page received it
    this.queue = []; // [chunk, when it arrived], not yet on screen
    this.shown = -Infinity; // when the canvas on screen was drawn
    this.timer = null;
    follow = true; // the user just sent it: always in view
    toEnd();
  }

  chunk(chunk) {
    this.queue.push([chunk, performance.now()]);
    if (this.timer === null) this.play();
  }

  play() {
    // Draws what came in order; a draft (and the end) waits until the canvas on screen has had its PACE_MS
    // (when Pace is on).
    this.timer = null;
    while (this.queue.length) {
      const [chunk] = this.queue[0];
      const paced = (chunk.dgemma_draft || chunk.end) && $("pace").checked;
      const wait = paced ? this.shown + PACE_MS - performance.now() : 0;
      if (wait > 0) { this.timer = setTimeout(() => this.play(), wait); return; }
      this.apply(...this.queue.shift());
    }
  }

  flush() {
    // Everything that came, at once (the end of a turn: stopped, failed, or Stop pressed during the replay); a
    // step that a later step of its block follows is only recorded (for the replay), not drawn.
    clearTimeout(this.timer);
    this.timer = null;
    while (this.queue.length) {
      const [chunk, arrived] = this.queue.shift();
      const next = this.queue.length && this.queue[0][0].dgemma_draft;
      if (chunk.dgemma_draft && next && next.block === chunk.dgemma_draft.block) this.record(chunk.dgemma_draft);
      else this.apply(chunk, arrived);
    }
  }

  played(signal) {
    // Resolves when all that came has been on screen (the last canvas for its PACE_MS too); Stop (the signal)
    // draws the rest at once.
    return new Promise((resolve) => {
      if (signal.aborted) { this.flush(); resolve(); return; }
      signal.addEventListener("abort", () => { this.flush(); resolve(); }, {once: true});
      this.chunk({end: resolve});
    });
  }

  apply(chunk, arrived) {
    if (chunk.end) return chunk.end();
    if (chunk.dgemma_draft) this.draft(chunk.dgemma_draft, arrived);
    const delta = chunk.choices && chunk.choices[0] && chunk.choices[0].delta;
    if (delta && delta.reasoning_content) {
      this.reasoning.hidden = false;
      this.reasoningText.textContent += delta.reasoning_content;
    }
    if (delta && delta.content) {
      this.content += delta.content;
      this.answer.textContent = this.content;
    }
    if (follow) toEnd();
  }

  record(d) {
    if (d.step === 1 || (this.frames.length && this.frames[0].block !== d.block)) this.frames = [];
    this.frames.push(d);
  }

  draft(d, arrived) {
    this.record(d);
    draw(this.canvas, d, this.frames.at(-2));
    this.label.textContent = `block ${d.block + 1} · step ${d.step}/${d.max_steps} · mean entropy ${d.mean_entropy.toFixed(4)}`;
    if (d.final) {
      const seconds = (arrived - this.clock) / 1000;
      this.clock = arrived;
      this.blocks.append(keptBlock(d, seconds, this.frames));
    }
    this.shown = performance.now(); // after this draft's own DOM work: its PACE_MS counts from when it is done
  }

  end(state, note) {
    this.flush();
    this.li.dataset.state = state;
    this.canvas.remove();
    this.label.textContent = note || "";
    if (!note) this.label.remove();
    if (follow) toEnd();
  }

  finish() { this.end("done"); }

  stop() { this.end("stopped", "stopped; this turn is not sent as context"); }

  fail(message) {
    this.end("error");
    const p = el("p", "error", message);
    p.setAttribute("role", "alert");
    this.li.append(p);
  }
}

function draw(canvas, d, previous) {
  // One draft as canvas cells (`previous`: the draft before it in the block, for what it had accepted).
  canvas.replaceChildren(...(d.tokens || d.token_ids.map(String)).map((piece, i) => {
    const span = el("span", "tok " + kind(d, i, previous ? previous.accepted : []), display(piece));
    if (d.entropy) span.title = `${d.token_ids[i]} · entropy ${d.entropy[i].toFixed(4)} nats`;
    return span;
  }));
  canvas.dataset.frame = `${d.block}:${d.step}`;
}

function keptBlock(d, seconds, frames) {
  // A committed block: its figures, and (folded) its last canvas with a replay of its steps.
  const n = d.committed !== undefined ? d.committed : d.token_ids.length; // without padding, when the server says
  const li = el("li");
  const details = el("details", "kept");
  details.append(el("summary", "", `block ${d.block + 1}: ${d.step} steps · ${seconds.toFixed(2)} s · ` +
                                    `${(n / d.step).toFixed(2)} tokens/step`));
  const canvas = el("div", "canvas");
  canvas.setAttribute("role", "img");
  canvas.setAttribute("aria-label", `Block ${d.block + 1}, last step`);
  draw(canvas, d, frames.at(-2));
  const replay = el("button", "replay", "Replay");
  replay.type = "button";
  replay.setAttribute("aria-label", `Replay block ${d.block + 1}`);
  const steps = [...frames];
  replay.addEventListener("click", () => {
    // Each step again at PACE_MS, ending on the last one.
    clearTimeout(replay.timer);
    const next = (i) => {
      draw(canvas, steps[i], steps[i - 1]);
      if (i + 1 < steps.length) replay.timer = setTimeout(() => next(i + 1), PACE_MS);
    };
    next(0);
  });
  details.append(canvas, replay);
  li.append(details);
  return li;
}

function kind(d, i, previous) {
  // noise: not accepted this step (renoised); sampled: newly accepted; accepted: kept from the previous step.
  // The entropy level (e0 high .. e3 below 0.001 nats) sets the shade.
  if (!d.accepted[i]) return "noise";
  const level = d.entropy ? ENTROPY_EDGES.filter((edge) => d.entropy[i] < edge).length : 3;
  return (previous[i] ? "kept" : "new") + " e" + level;
}

function display(piece) {
  // Visible whitespace so that noise never breaks the layout (as `dgemma watch` draws a cell).
  if (piece === "") return "∅";
  return piece.replace(/[\n\t\r]/g, (c) => ({"\n": "↵", "\t": "→", "\r": "␍"})[c])
              .replace(/[\x00-\x1f\x7f]/g, "·");
}

// ---- keyboard and buttons ----------------------------------------------------------------------------------

function stop() { if (running) running.abort(); }

$("composer").addEventListener("submit", (event) => { event.preventDefault(); send(); });
$("stop").addEventListener("click", stop);
$("new-chat").addEventListener("click", newChat);
for (const example of document.querySelectorAll(".example")) {
  example.addEventListener("click", () => { $("prompt").value = example.textContent; send(); });
}
for (const input of document.querySelectorAll(".fields [name]")) {
  input.addEventListener("input", () => input.removeAttribute("aria-invalid"));
}
$("prompt").addEventListener("keydown", (event) => {
  if (event.key === "Enter" && !event.shiftKey && !event.isComposing) { event.preventDefault(); send(); }
});
document.addEventListener("keydown", (event) => { if (event.key === "Escape") stop(); });

$("settings").open = window.matchMedia("(min-width: 800px)").matches;
checkKey();
$("prompt").focus();
