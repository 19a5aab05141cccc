"use strict";
// NInfer's built-in chat page. It streams /v1/chat/completions over SSE with fetch and a
// ReadableStream (no EventSource: that cannot POST), shows delta.reasoning_content apart from
// the answer, aborts the request with an AbortController when Stop is pressed (the server then
// aborts the engine request), and reports decode speed in tokens per second.
// No build step and no third-party code: the files are served as they are.

const els = {
  messages: document.getElementById("messages"),
  form: document.getElementById("composer"),
  prompt: document.getElementById("prompt"),
  send: document.getElementById("send"),
  stop: document.getElementById("stop"),
  clear: document.getElementById("clear"),
  maxTokens: document.getElementById("max-tokens"),
  temperature: document.getElementById("temperature"),
  thinking: document.getElementById("thinking"),
  modelName: document.getElementById("model-name"),
  stats: document.getElementById("stats"),
};

const state = {
  model: null,
  history: [],
  controller: null,
};

async function loadModelName() {
  try {
    const resp = await fetch("/v1/models");
    const body = await resp.json();
    state.model = body.data && body.data.length ? body.data[0].id : null;
    els.modelName.textContent = state.model || "no model listed";
  } catch (err) {
    els.modelName.textContent = "model list unavailable";
  }
}

function addMessage(role, text) {
  const root = document.createElement("div");
  root.className = `msg ${role}`;
  if (role !== "assistant") {
    root.textContent = text;
    els.messages.appendChild(root);
    scrollToEnd();
    return { root };
  }
  const reasoning = document.createElement("details");
  reasoning.className = "reasoning";
  reasoning.hidden = true;
  reasoning.open = true;
  const summary = document.createElement("summary");
  summary.textContent = "Reasoning";
  const reasoningText = document.createElement("div");
  reasoningText.className = "reasoning-text";
  reasoning.append(summary, reasoningText);
  const answer = document.createElement("div");
  answer.className = "answer";
  const meta = document.createElement("div");
  meta.className = "msg-meta";
  root.append(reasoning, answer, meta);
  els.messages.appendChild(root);
  scrollToEnd();
  return { root, reasoning, summary, reasoningText, answer, meta };
}

// Renders text with ``` fenced blocks as <pre><code>; everything goes in as text nodes.
function renderAnswer(el, text) {
  el.replaceChildren();
  const parts = text.split("```");
  parts.forEach((part, i) => {
    if (i % 2 === 0) {
      if (part) el.appendChild(document.createTextNode(part.replace(/^\n/, "")));
      return;
    }
    const newline = part.indexOf("\n");
    const code = newline >= 0 && /^[\w+-]*$/.test(part.slice(0, newline)) ? part.slice(newline + 1) : part;
    const pre = document.createElement("pre");
    const codeEl = document.createElement("code");
    codeEl.textContent = code.replace(/\n$/, "");
    pre.appendChild(codeEl);
    el.appendChild(pre);
  });
}

function scrollToEnd() {
  els.messages.scrollTop = els.messages.scrollHeight;
}

// Yields the data of each server-sent event ("data:" lines joined by "\n") as it arrives.
async function* sseData(response) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  let data = [];
  for (;;) {
    const { value, done } = await reader.read();
    buffer += decoder.decode(value || new Uint8Array(), { stream: !done });
    let newline;
    while ((newline = buffer.search(/\r?\n/)) >= 0) {
      const line = buffer.slice(0, newline);
      buffer = buffer.slice(buffer[newline] === "\r" ? newline + 2 : newline + 1);
      if (line === "") {
        if (data.length) yield data.join("\n");
        data = [];
      } else if (line.startsWith("data:")) {
        data.push(line.slice(5).replace(/^ /, ""));
      }
    }
    if (done) {
      if (buffer.startsWith("data:")) data.push(buffer.slice(5).replace(/^ /, ""));
      if (data.length) yield data.join("\n");
      return;
    }
  }
}

// Speed of one response: time to first token and decode tokens per second.
class Meter {
  constructor() {
    this.start = performance.now();
    this.first = null;
    this.last = null;
    this.tokens = 0;
  }
  token(count = 1) {
    const now = performance.now();
    if (this.first === null) this.first = now;
    this.last = now;
    this.tokens += count;
  }
  tokensPerSecond() {
    if (this.tokens < 2 || this.last === this.first) return null;
    return (this.tokens - 1) / ((this.last - this.first) / 1000);
  }
  describe() {
    const parts = [`${this.tokens} tokens`];
    const tps = this.tokensPerSecond();
    if (tps !== null) parts.unshift(`${tps.toFixed(1)} tok/s`);
    if (this.first !== null) parts.push(`TTFT ${Math.round(this.first - this.start)} ms`);
    return parts.join(" · ");
  }
}

function setBusy(busy) {
  els.send.disabled = busy;
  els.stop.disabled = !busy;
}

function requestBody() {
  const body = {
    messages: state.history,
    stream: true,
    stream_options: { include_usage: true },
  };
  if (state.model) body.model = state.model;
  const maxTokens = parseInt(els.maxTokens.value, 10);
  if (maxTokens > 0) body.max_tokens = maxTokens;
  const temperature = parseFloat(els.temperature.value);
  if (!Number.isNaN(temperature)) body.temperature = temperature;
  if (!els.thinking.checked) body.chat_template_kwargs = { enable_thinking: false };
  return body;
}

async function errorMessage(resp) {
  try {
    const body = await resp.json();
    if (body && body.error) return body.error.message || JSON.stringify(body.error);
  } catch (err) {
    // not JSON: fall through to the status line
  }
  return `HTTP ${resp.status} ${resp.statusText}`;
}

async function send(text) {
  state.history.push({ role: "user", content: text });
  addMessage("user", text);
  const view = addMessage("assistant");
  view.root.classList.add("streaming");
  const meter = new Meter();
  const controller = new AbortController();
  state.controller = controller;
  setBusy(true);
  let answer = "";
  let reasoning = "";
  let finish = null;
  let usage = null;
  let outcome = "done";
  try {
    const resp = await fetch("/v1/chat/completions", {
      method: "POST",
      headers: { "Content-Type": "application/json", Accept: "text/event-stream" },
      body: JSON.stringify(requestBody()),
      signal: controller.signal,
    });
    if (!resp.ok) throw new Error(await errorMessage(resp));
    for await (const data of sseData(resp)) {
      if (data === "[DONE]") break;
      const chunk = JSON.parse(data);
      if (chunk.error) throw new Error(chunk.error.message || JSON.stringify(chunk.error));
      if (chunk.usage) usage = chunk.usage;
      const choice = chunk.choices && chunk.choices[0];
      if (!choice) continue;
      const delta = choice.delta || {};
      if (delta.reasoning_content) {
        reasoning += delta.reasoning_content;
        view.reasoning.hidden = false;
        view.reasoningText.textContent = reasoning;
        meter.token();
      }
      if (delta.content) {
        if (reasoning && view.reasoning.open && !answer) view.reasoning.open = false;
        answer += delta.content;
        renderAnswer(view.answer, answer);
        meter.token();
      }
      if (choice.finish_reason) finish = choice.finish_reason;
      els.stats.textContent = meter.describe();
      scrollToEnd();
    }
  } catch (err) {
    if (err.name === "AbortError") {
      outcome = "stopped";
    } else {
      outcome = "error";
      view.root.classList.add("error");
      const line = document.createElement("div");
      line.className = "error-text";
      line.textContent = `Error: ${err.message}`;
      view.root.insertBefore(line, view.meta);
    }
  } finally {
    if (state.controller === controller) state.controller = null;
    view.root.classList.remove("streaming");
    view.root.classList.add(outcome);
    setBusy(false);
  }
  if (usage && usage.completion_tokens) meter.tokens = usage.completion_tokens;
  const status = outcome === "stopped" ? "stopped" : finish ? `finish: ${finish}` : outcome;
  view.meta.textContent = `${meter.describe()} · ${status}`;
  if (outcome === "stopped") view.meta.classList.add("stopped");
  els.stats.textContent = meter.describe();
  if (answer) state.history.push({ role: "assistant", content: answer });
  else state.history.pop();
}

els.form.addEventListener("submit", (event) => {
  event.preventDefault();
  const text = els.prompt.value.trim();
  if (!text || state.controller) return;
  els.prompt.value = "";
  send(text);
});

els.prompt.addEventListener("keydown", (event) => {
  if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
    event.preventDefault();
    els.form.requestSubmit();
  }
});

els.stop.addEventListener("click", () => {
  if (state.controller) state.controller.abort();
});

els.clear.addEventListener("click", () => {
  if (state.controller) state.controller.abort();
  state.history = [];
  els.messages.replaceChildren();
  els.stats.textContent = "";
});

loadModelName();
