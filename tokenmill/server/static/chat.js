// The web chat page: each turn sends the whole conversation to /v1/chat/completions and reads
// the answer as it streams back (SSE over fetch: EventSource cannot POST), with its timings.
// Model output is only ever set as textContent, never parsed as HTML.
"use strict";

const $ = (id) => document.getElementById(id);
const SAVED = ["api-key", "system", "temperature", "top-p", "max-tokens"];  // in localStorage
const history = [];  // {role, content} of the conversation so far, without the system prompt
let controller = null;  // the AbortController of the answer being streamed, if any

class ServerError extends Error {}

function headers() {
  const key = $("api-key").value.trim();
  return key ? {"Content-Type": "application/json", Authorization: `Bearer ${key}`}
             : {"Content-Type": "application/json"};
}

async function errorText(response) {
  let message = `HTTP ${response.status}`;
  try {
    message = (await response.json()).error.message || message;
  } catch { /* not an OpenAI error body */ }
  if (response.status === 401) message += ". Enter the server's API key in the settings.";
  return message;
}

function notice(text) {
  $("notice").textContent = text;
  $("notice").hidden = !text;
}

async function loadModels() {
  try {
    const response = await fetch("v1/models", {headers: headers()});
    if (!response.ok) throw new ServerError(await errorText(response));
    const {data} = await response.json();
    $("model").replaceChildren(...data.map((m) => new Option(m.id)));
    notice("");
  } catch (e) {
    notice(`Cannot list the models: ${e.message}`);
  }
}

function addMessage(role, text) {
  const message = document.createElement("div");
  message.className = `message ${role}`;
  const body = document.createElement("div");
  body.className = "text";
  body.textContent = text;
  message.append(body);
  $("log").append(message);
  $("log").scrollTop = $("log").scrollHeight;
  return message;
}

function requestBody() {
  const system = $("system").value.trim();
  const number = (id) => ($(id).value === "" ? undefined : Number($(id).value));
  return {
    model: $("model").value || undefined,
    messages: system ? [{role: "system", content: system}, ...history] : history,
    temperature: number("temperature"),
    top_p: number("top-p"),
    max_tokens: number("max-tokens"),
    stream: true,
    stream_options: {include_usage: true},
  };
}

// Calls onEvent with each JSON event of a text/event-stream body, until [DONE].
async function readEvents(response, onEvent) {
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  for (;;) {
    const {value, done} = await reader.read();
    if (done) return;
    const events = (buffer += value).split(/\r?\n\r?\n/);
    buffer = events.pop();  // an event not complete yet
    for (const event of events) {
      const data = event.split(/\r?\n/).filter((line) => line.startsWith("data:"))
        .map((line) => line.slice(line.startsWith("data: ") ? 6 : 5)).join("\n");
      if (data === "[DONE]") return;
      if (data) onEvent(JSON.parse(data));
    }
  }
}

// One answer: its text as it streams in, and what the stats line needs.
function streamInto(turn, response) {
  return readEvents(response, (chunk) => {
    if (chunk.error) throw new ServerError(chunk.error.message);
    const choice = chunk.choices?.[0];
    if (choice?.delta?.content) {
      turn.first ??= performance.now();
      turn.text += choice.delta.content;
      turn.body.textContent = turn.text;
      $("log").scrollTop = $("log").scrollHeight;
    }
    turn.finish = choice?.finish_reason ?? turn.finish;
    if (chunk.usage) turn.usage = chunk.usage;
  });
}

function showStats(turn, stopped) {
  const parts = [];
  if (turn.first !== undefined) parts.push(`TTFT ${Math.round(turn.first - turn.start)} ms`);
  const usage = turn.usage;
  if (usage) {
    // the first token's time is in TTFT: the rate is of the tokens that came after it
    const seconds = (turn.end - turn.first) / 1000;
    const rate = usage.completion_tokens > 1 && seconds > 0
      ? ((usage.completion_tokens - 1) / seconds).toFixed(1) : "–";
    const cached = usage.prompt_tokens_details?.cached_tokens ?? 0;
    parts.push(`${rate} tok/s`, `${usage.completion_tokens} tokens`,
               `${cached} of ${usage.prompt_tokens} prompt tokens cached`);
  }
  if (stopped) parts.push("stopped");
  else if (turn.finish === "length") parts.push("cut at max_tokens");
  const stats = document.createElement("div");
  stats.className = "stats";
  stats.textContent = parts.join(" · ");
  turn.message.append(stats);
}

function setBusy(busy) {
  $("send").disabled = busy;
  $("stop").disabled = !busy;
}

async function send(event) {
  event.preventDefault();
  const text = $("input").value.trim();
  if (!text || controller) return;
  $("input").value = "";
  const question = addMessage("user", text);
  history.push({role: "user", content: text});
  const message = addMessage("assistant", "");
  const turn = {message, body: message.firstChild, text: "", start: performance.now()};
  controller = new AbortController();
  setBusy(true);
  try {
    const response = await fetch("v1/chat/completions", {
      method: "POST", headers: headers(), body: JSON.stringify(requestBody()),
      signal: controller.signal,
    });
    if (!response.ok) throw new ServerError(await errorText(response));
    await streamInto(turn, response);
    turn.end = performance.now();
    history.push({role: "assistant", content: turn.text});
    showStats(turn, false);
  } catch (e) {
    if (!message.isConnected) return;  // New chat: this turn was thrown away
    if (e.name === "AbortError") {  // Stop: keep what came, the server aborts the rest
      history.push({role: "assistant", content: turn.text});
      showStats(turn, true);
    } else {  // this turn did not happen: take it back, so that it can be sent again
      history.pop();
      question.classList.add("unsent");
      message.className = "message error";
      turn.body.textContent = e instanceof ServerError ? e.message : `Request failed: ${e}`;
      if (!$("input").value) $("input").value = text;
    }
  } finally {
    controller = null;
    setBusy(false);
  }
}

function newChat() {
  controller?.abort();
  history.length = 0;
  $("log").replaceChildren();
}

for (const id of SAVED) {
  const key = `tokenmill.${id}`;
  if (localStorage.getItem(key) !== null) $(id).value = localStorage.getItem(key);
  $(id).addEventListener("input", () => localStorage.setItem(key, $(id).value));
}
$("api-key").addEventListener("change", loadModels);
$("composer").addEventListener("submit", send);
$("stop").addEventListener("click", () => controller?.abort());
$("new-chat").addEventListener("click", newChat);
$("input").addEventListener("keydown", (e) => {
  if (e.key === "Enter" && !e.shiftKey && !e.isComposing) {
    e.preventDefault();
    $("composer").requestSubmit();
  }
});
loadModels();
