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
  model: $("model"), processing: $("processing"), source: $("source"), file: $("file"),
  media: $("media"),
  start: $("start"), stop: $("stop"), status: $("status"), error: $("error"),
  video: $("video"), input: $("input"), result: $("result"),
  fps: $("fps"), latency: $("latency"), serverLatency: $("server-latency"), dropped: $("dropped"),
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
  const query = new URLSearchParams(location.search);
  if (names.has(query.get("model"))) el.model.value = query.get("model");
  if (query.has("processing")) el.processing.value = query.get("processing");
  el.status.textContent = names.size ? "ready" : "no models";
}

// Loads the chosen model when it is a repository model not loaded yet, and
// returns its metadata.
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

// The session's processing (docs/websocket.md, "Processing"): the one chosen, or
// for "auto" what the model's input asks for: a UINT8 image input takes the
// decoded frame as it is ("none"); a float [N, 3, H, W] input is a text detector
// (PP-OCR det), which "text_boxes" resizes and normalizes the frame for and
// turns the probability map into boxes.
function processingFor(metadata) {
  if (el.processing.value !== "auto") return el.processing.value;
  const input = (metadata.inputs || [])[0];
  const chw = input && input.shape.length === 4 && input.shape[1] === 3;
  return input && input.datatype === "FP32" && chw ? "text_boxes" : "none";
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
  constructor(model, kind, processing) {
    this.model = model;
    this.kind = kind;
    this.processing = processing;
    this.sourceSize = null;    // [width, height], from the first result
    this.maxInflight = 1;      // until the server says
    this.open = false;
    this.ended = false;        // the server-side source has ended
    this.sent = 0;             // frames sent (the next one's index)
    this.pending = new Map();  // index -> {sentAt, frame (ImageBitmap)}
    this.peak = 0;             // the most frames that were in flight at once
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

  // The session's first message (docs/websocket.md, "Opening a session"): JPEG
  // frames, results as binary messages (a JSON header, then the outputs' bytes:
  // an image output is a JPEG the page draws as it is).
  opening() {
    const message = { encoding: "jpeg", output_format: "binary", processing: this.processing };
    // `?inflight=N` in the page's URL asks for N frames in flight (else the server's default).
    const inflight = Number(new URLSearchParams(location.search).get("inflight"));
    if (inflight > 0) message.max_inflight_frames = inflight;
    if (this.kind === "media") message.source = { media: el.media.value };
    return message;
  }

  receive(data) {
    let header;
    let body = null;
    try {
      [header, body] = typeof data === "string" ? [JSON.parse(data), null] : splitBinary(data);
    } catch (e) {
      return showError(`a message the page cannot read: ${e.message}`);
    }
    if (header.event === "opened") {
      this.maxInflight = Math.max(1, header.max_inflight_frames || 1);
      this.open = true;
      el.status.textContent =
        `streaming to ${header.model_name} (session ${header.session}, processing ${this.processing})`;
      this.pump();
    } else if (header.event === "end") {
      this.ended = true;
      el.status.textContent = `the source ended after ${header.frames} frames`;
    } else if (header.frame === undefined) {
      // A protocol error: the server closes the session next.
      showError(header.error || JSON.stringify(header));
    } else {
      this.result(header, body);
    }
  }

  // One frame's answer: its image output (the inverted frame) or the boxes
  // post-processing found, drawn beside the frame that was sent.
  async result(header, body) {
    if (header.source) this.sourceSize = [header.source.width, header.source.height];
    if (header.dropped) this.dropped = Object.values(header.dropped).reduce((s, n) => s + n, 0);
    const index = header.frame;
    // Results come in the order the frames were sent: a frame before this one
    // still pending was dropped by the server (it never gets a message).
    for (const [i, p] of this.pending) {
      if (i < index) { if (p.frame) p.frame.close(); this.pending.delete(i); }
    }
    const sent = this.pending.get(index);
    this.pending.delete(index);
    const now = performance.now();
    this.answers.push({ at: now, latency: sent ? now - sent.sentAt : undefined, server: header.latency_ms });
    this.answered += 1;
    if (header.error !== undefined) {
      showError(header.error);
    } else {
      await draw(sent && sent.frame, imageOutput(header, body), header.boxes, this.sourceSize);
    }
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
      const [frame, jpeg] = await capture(video);
      if (!this.open) { frame.close(); return; }
      const index = this.sent++;
      this.pending.set(index, { sentAt: performance.now(), frame });
      this.peak = Math.max(this.peak, this.pending.size);
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
    el.fps.textContent = fps.toFixed(1);
    el.latency.textContent = mean(a.map((x) => x.latency));
    el.serverLatency.textContent = mean(a.map((x) => x.server));
    el.dropped.textContent = String(this.dropped);
    el.answered.textContent = String(this.answered);
    el.inflight.textContent = `${this.pending.size} (${this.maxInflight})`;
    el.inflight.dataset.peak = String(this.peak);
  }

  closed(event) {
    this.open = false;
    if (session === this) stop(this.ended ? el.status.textContent : "stopped");
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

// The mean of the defined numbers of `values`, as text ("–" when none).
function mean(values) {
  const defined = values.filter((x) => typeof x === "number");
  if (!defined.length) return "–";
  return (defined.reduce((s, x) => s + x, 0) / defined.length).toFixed(1);
}

// A binary result: a little-endian u32 n, n bytes of JSON, then the outputs' bytes.
function splitBinary(buffer) {
  const n = new DataView(buffer).getUint32(0, true);
  if (4 + n > buffer.byteLength) throw new Error(`a header of ${n} bytes in a message of ${buffer.byteLength}`);
  const header = JSON.parse(new TextDecoder().decode(new Uint8Array(buffer, 4, n)));
  return [header, new Uint8Array(buffer, 4 + n)];
}

// The bytes of the first JPEG output of a binary result, or null.
function imageOutput(header, body) {
  if (!body) return null;
  let offset = 0;
  for (const output of header.outputs || []) {
    const size = output.binary_data_size || 0;
    if (output.content_type === "image/jpeg") return body.subarray(offset, offset + size);
    offset += size;
  }
  return null;
}

// The canvas each frame is captured on (one, reused).
const captureCanvas = document.createElement("canvas");

// The video's current frame: a copy to draw beside its result, and its JPEG
// bytes. Both calls take the canvas as it is when they are made.
async function capture(video) {
  const canvas = captureCanvas;
  if (canvas.width !== video.videoWidth) canvas.width = video.videoWidth;
  if (canvas.height !== video.videoHeight) canvas.height = video.videoHeight;
  canvas.getContext("2d").drawImage(video, 0, 0);
  const frame = createImageBitmap(canvas);
  const blob = new Promise((resolve) => canvas.toBlob(resolve, "image/jpeg", JPEG_QUALITY));
  return Promise.all([frame, blob.then((b) => b.arrayBuffer())]);
}

// Draws the frame sent on #input and the result on #result: the returned image,
// or the frame with the boxes over it (over a grey field of the source's size
// when kiln decoded the frame itself and sent only boxes). Both are drawn in one
// task, so the two canvases always show the same frame.
async function draw(frame, image, boxes, sourceSize) {
  const picture = image ? await createImageBitmap(new Blob([image], { type: "image/jpeg" })) : null;
  if (frame) paint(el.input, frame);
  if (picture) {
    paint(el.result, picture);
    picture.close();
  } else if (frame) {
    paint(el.result, frame);
  } else if (sourceSize) {
    blank(el.result, sourceSize);
  }
  if (boxes) {
    // Green, 2 px, on the boxes' edges (ends exclusive: x1 - x0 wide).
    const ctx = el.result.getContext("2d");
    ctx.strokeStyle = "#00ff00";
    ctx.lineWidth = 2;
    for (const b of boxes) ctx.strokeRect(b.x0, b.y0, b.x1 - b.x0, b.y1 - b.y0);
    el.boxes.textContent = String(boxes.length);
    el.boxes.dataset.boxes = JSON.stringify(boxes);
  }
}

function blank(canvas, [width, height]) {
  canvas.width = width;
  canvas.height = height;
  const ctx = canvas.getContext("2d");
  ctx.fillStyle = "#444";
  ctx.fillRect(0, 0, width, height);
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
    // A server-side source sends no frame from here: only the result is shown.
    $("input-figure").hidden = kind === "media";
    if (kind !== "media") await openVideo(kind);
    session = new Session(model, kind, processingFor(metadata));
    el.stop.disabled = false;
    el.status.textContent = `opening a session with ${model}…`;
  } catch (e) {
    showError(e.message || String(e));
    stop();
  }
}

function stop(status = "stopped") {
  if (session) { const s = session; session = null; s.close(); }
  closeVideo();
  el.start.disabled = false;
  el.stop.disabled = true;
  el.status.textContent = status;
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
el.stop.addEventListener("click", () => stop());
showSourceControls();
watchFrames();
listModels().catch((e) => showError(`listing the models: ${e.message || e}`));
