// kiln's video page: pick a model and a source, stream frames over the model's
// WebSocket (docs/websocket.md) and show each frame's result with the frame rate,
// the latency per frame and the frames the server dropped.
//
// Flow: the source (a camera or a local file in the <video>, or a media file the
// server decodes itself) -> a frame drawn on a canvas -> JPEG (canvas.toBlob) ->
// one binary message. At most `max_inflight_frames` (the server's number, from
// its answer to the session's opening) are sent and unanswered at a time; a new
// frame is sent when the camera has one and a place is free.
"use strict";

const $ = (id) => document.getElementById(id);
const el = {
  model: $("model"), source: $("source"), file: $("file"), media: $("media"),
  start: $("start"), stop: $("stop"), status: $("status"), error: $("error"),
  video: $("video"), input: $("input"), result: $("result"),
  fps: $("fps"), latency: $("latency"), dropped: $("dropped"),
  answered: $("answered"), inflight: $("inflight"), boxes: $("boxes"),
};

// JPEG quality of the frames sent (canvas.toBlob's 0..1).
const JPEG_QUALITY = 0.85;
// The window the frame rate and the mean latency are measured over.
const WINDOW_MS = 2000;

let session = null;

// ---- models -------------------------------------------------------------------

// The loaded models (GET /v2/models) and those of the repository
// (POST /v2/repository/index), loaded ones first.
async function listModels() {
  const names = new Map();
  const loaded = await fetch("/v2/models").then((r) => r.json());
  for (const m of loaded.models || []) names.set(m.name, m.state);
  try {
    const index = await fetch("/v2/repository/index", {
      method: "POST", headers: { "content-type": "application/json" }, body: "{}",
    });
    if (index.ok) {
      for (const m of await index.json()) if (!names.has(m.name)) names.set(m.name, m.state || "");
    }
  } catch (e) { /* the repository API may be restricted: the loaded models remain */ }
  el.model.replaceChildren();
  for (const [name, state] of names) {
    const option = new Option(state === "READY" ? name : `${name} (${state || "not loaded"})`, name);
    option.dataset.state = state;
    el.model.add(option);
  }
  const preferred = new URLSearchParams(location.search).get("model");
  if (preferred && names.has(preferred)) el.model.value = preferred;
  el.status.textContent = names.size ? "ready" : "no models";
}

// The model's metadata; a repository model that is not loaded is loaded first.
async function prepareModel(name) {
  const option = el.model.selectedOptions[0];
  if (option && option.dataset.state !== "READY") {
    el.status.textContent = `loading ${name}…`;
    const r = await fetch(`/v2/repository/models/${encodeURIComponent(name)}/load`, {
      method: "POST", headers: { "content-type": "application/json" }, body: "{}",
    });
    if (!r.ok) throw new Error(`loading ${name}: ${(await r.json()).error || r.status}`);
    option.dataset.state = "READY";
    option.text = name;
  }
  const r = await fetch(`/v2/models/${encodeURIComponent(name)}`);
  if (!r.ok) throw new Error(`${name}: ${(await r.json()).error || r.status}`);
  return r.json();
}

// ---- sources ------------------------------------------------------------------

// Shows the chosen source's own control (a file picker, a media name).
function showSourceControls() {
  el.file.hidden = el.source.value !== "file";
  el.media.hidden = el.source.value !== "media";
}

// Starts the client-side source in the <video>: the camera or a local file.
async function openVideo(kind) {
  const video = el.video;
  if (kind === "webcam") {
    video.srcObject = await navigator.mediaDevices.getUserMedia({ video: true, audio: false });
  } else {
    const file = el.file.files[0];
    if (!file) throw new Error("choose a video file");
    video.srcObject = null;
    video.src = URL.createObjectURL(file);
    video.loop = true;
  }
  await video.play();
}

function closeVideo() {
  const video = el.video;
  if (video.srcObject) for (const track of video.srcObject.getTracks()) track.stop();
  video.pause();
  if (video.src) URL.revokeObjectURL(video.src);
  video.srcObject = null;
  video.removeAttribute("src");
}

// ---- the session --------------------------------------------------------------

class Session {
  constructor(model, metadata, kind) {
    this.model = model;
    this.kind = kind;
    this.input = metadata.inputs && metadata.inputs[0] ? metadata.inputs[0].name : undefined;
    this.maxInflight = 1;      // until the server says
    this.open = false;
    this.sent = 0;             // frames sent (the next one's index)
    this.pending = new Map();  // index -> {sentAt, frame (ImageBitmap)}
    this.encoding = false;     // a frame is being captured and encoded
    this.freshFrame = false;   // the video has a frame not sent yet
    this.answers = [];         // [{at, latency}] within WINDOW_MS
    this.answered = 0;
    this.dropped = 0;
    const scheme = location.protocol === "https:" ? "wss:" : "ws:";
    const path = `/v2/models/${encodeURIComponent(model)}/stream`;
    this.ws = new WebSocket(`${scheme}//${location.host}${path}`);
    this.ws.binaryType = "arraybuffer";
    this.ws.onopen = () => this.ws.send(JSON.stringify(this.opening()));
    this.ws.onmessage = (e) => this.receive(e.data);
    this.ws.onclose = (e) => this.closed(e);
  }

  // The session's first message (docs/websocket.md, "Opening a session").
  opening() {
    const message = { input: this.input, encoding: "jpeg" };
    if (this.kind === "media") message.source = { media: el.media.value };
    return message;
  }

  receive(data) {
    if (typeof data !== "string") return this.binary(data);
    const message = JSON.parse(data);
    if (message.error !== undefined && message.frame === undefined) {
      showError(message.error);
    } else if (message.type === "session" || message.max_inflight_frames !== undefined) {
      this.maxInflight = Math.max(1, message.max_inflight_frames || 1);
      this.open = true;
      el.status.textContent = `streaming to ${this.model}`;
      this.pump();
    } else {
      this.result(message, null);
    }
  }

  binary(buffer) {
    this.result(this.awaitingImage, buffer);
  }

  // One frame's answer: its image (inverted frame) or boxes, drawn beside the frame sent.
  async result(message, image) {
    if (message.dropped !== undefined) this.dropped = message.dropped;
    const index = message.frame;
    // Answers come in the order the frames were sent: a frame before this one
    // still pending was dropped by the server.
    for (const [i, p] of this.pending) {
      if (i < index) { p.frame && p.frame.close(); this.pending.delete(i); }
    }
    const sent = this.pending.get(index);
    this.pending.delete(index);
    const now = performance.now();
    this.answers.push({ at: now, latency: sent ? now - sent.sentAt : undefined });
    this.answered += 1;
    if (message.error !== undefined) showError(`frame ${index}: ${message.error}`);
    else await draw(sent && sent.frame, image, message.boxes);
    if (sent && sent.frame) sent.frame.close();
    this.report();
    this.pump();
  }

  // Sends the video's current frame when it has a new one and a place is free.
  async pump() {
    if (!this.open || this.encoding || this.kind === "media") return;
    if (this.pending.size >= this.maxInflight || !this.freshFrame) return;
    const video = el.video;
    if (video.readyState < 2 || !video.videoWidth) return;
    this.encoding = true;
    this.freshFrame = false;
    try {
      const canvas = new OffscreenCanvas(video.videoWidth, video.videoHeight);
      canvas.getContext("2d").drawImage(video, 0, 0);
      const frame = canvas.transferToImageBitmap();
      const jpeg = await toJpeg(frame);
      if (!this.open) { frame.close(); return; }
      const index = this.sent++;
      this.pending.set(index, { sentAt: performance.now(), frame });
      this.ws.send(jpeg);
      this.report();
    } finally {
      this.encoding = false;
    }
  }

  // The numbers the page shows: frames per second and mean latency over the
  // last WINDOW_MS, the server's dropped-frame count.
  report() {
    const now = performance.now();
    while (this.answers.length && now - this.answers[0].at > WINDOW_MS) this.answers.shift();
    const a = this.answers;
    const fps = a.length > 1 ? (a.length - 1) * 1000 / (a[a.length - 1].at - a[0].at) : 0;
    const latencies = a.map((x) => x.latency).filter((x) => x !== undefined);
    el.fps.textContent = fps.toFixed(1);
    el.latency.textContent = latencies.length
      ? (latencies.reduce((s, x) => s + x, 0) / latencies.length).toFixed(1) : "–";
    el.dropped.textContent = String(this.dropped);
    el.answered.textContent = String(this.answered);
    el.inflight.textContent = `${this.pending.size} (${this.maxInflight})`;
  }

  closed(event) {
    this.open = false;
    if (session === this) stop();
    if (event.code !== 1000 && event.code !== 1005) {
      showError(`stream closed (${event.code}${event.reason ? `: ${event.reason}` : ""})`);
    }
  }

  close() {
    this.open = false;
    if (this.ws.readyState <= WebSocket.OPEN) this.ws.close(1000, "stopped");
    for (const p of this.pending.values()) if (p.frame) p.frame.close();
    this.pending.clear();
  }
}

// A frame as JPEG bytes.
async function toJpeg(frame) {
  const canvas = document.createElement("canvas");
  canvas.width = frame.width;
  canvas.height = frame.height;
  canvas.getContext("2d").drawImage(frame, 0, 0);
  const blob = await new Promise((resolve) => canvas.toBlob(resolve, "image/jpeg", JPEG_QUALITY));
  return blob.arrayBuffer();
}

// Draws the frame sent on #input and the result on #result: the returned image,
// or the frame with the boxes over it. Both are drawn in one task, so the two
// canvases always show the same frame.
async function draw(frame, image, boxes) {
  const picture = image ? await createImageBitmap(new Blob([image], { type: "image/jpeg" })) : null;
  if (frame) paint(el.input, frame);
  if (picture) { paint(el.result, picture); picture.close(); } else if (frame) paint(el.result, frame);
  if (boxes) {
    const ctx = el.result.getContext("2d");
    ctx.strokeStyle = "#00ff00";
    ctx.lineWidth = 2;
    for (const b of boxes) ctx.strokeRect(b[0], b[1], b[2] - b[0], b[3] - b[1]);
    el.boxes.textContent = String(boxes.length);
  }
}

function paint(canvas, bitmap) {
  if (canvas.width !== bitmap.width) canvas.width = bitmap.width;
  if (canvas.height !== bitmap.height) canvas.height = bitmap.height;
  canvas.getContext("2d").drawImage(bitmap, 0, 0);
}

// ---- controls -----------------------------------------------------------------

function showError(text) {
  el.error.textContent = text;
}

async function start(event) {
  event.preventDefault();
  stop();
  showError("");
  const model = el.model.value;
  const kind = el.source.value;
  el.start.disabled = true;
  try {
    const metadata = await prepareModel(model);
    if (kind !== "media") await openVideo(kind);
    session = new Session(model, metadata, kind);
    el.stop.disabled = false;
    el.status.textContent = `opening a session with ${model}…`;
  } catch (e) {
    showError(e.message || String(e));
    stop();
  }
}

function stop() {
  if (session) { const s = session; session = null; s.close(); }
  closeVideo();
  el.start.disabled = false;
  el.stop.disabled = true;
  el.status.textContent = "stopped";
}

// A new video frame makes the next send possible.
function watchFrames() {
  const video = el.video;
  const onFrame = () => {
    if (session) { session.freshFrame = true; session.pump(); }
    video.requestVideoFrameCallback(onFrame);
  };
  video.requestVideoFrameCallback(onFrame);
}

el.source.addEventListener("change", showSourceControls);
$("controls").addEventListener("submit", start);
el.stop.addEventListener("click", stop);
showSourceControls();
watchFrames();
listModels().catch((e) => showError(`listing the models: ${e.message || e}`));
