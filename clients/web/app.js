// duplex-server browser client: no dependencies, no build step.
// Mic (AudioWorklet, 16 kHz PCM16 binary frames) -> /v1/realtime (server VAD) -> 24 kHz
// audio deltas -> jitter buffer -> speakers. Barge-in flushes the local player at once, or,
// with "Confirm cuts" ticked (interrupt_mode: confirm, docs/protocol.md §6.1; the server's
// default in WebRTC mode), output_audio_buffer.paused pauses it at the speech onset,
// .resumed plays on from there (a listener's "mm-hm" or a cough: the cut is taken back,
// shown on the answer) and .cleared or response.done{cancelled} flushes it; a dropped
// socket is resumed (session.resume with the last seen server_event_seq, duplicates skipped).
// WebRTC mode (the toggle): the SDP offer goes to POST /v1/realtime/calls, audio is Opus
// both ways (the browser plays the server's track; the server flushes it on barge-in) and
// the same events ride the "oai-events" data channel.
"use strict";

const $ = (id) => document.getElementById(id);
const OUT_RATE = 24000;
const IN_RATE = 16000;
const JITTER_S = 0.08; // playback starts this far behind the first chunk of a burst

// Exposed for tests and curious users (read-only view of what happened).
const state = (window.duplexState = {
  connected: false, sessionId: null, userTranscripts: [], assistantTranscripts: [],
  ttfaMs: [], timings: [], responses: [], flushes: 0, resumes: 0, framesSent: 0,
  transport: "websocket", audioStarted: 0, audioCleared: 0, rtcPacketsReceived: 0,
  rtcAudioEnergy: 0, rtcJitterBufferMs: null, rtcJitterTargetMs: null, interrupted: 0,
  paused: 0, takenBack: 0,
});

// ------------------------------------------------------------------ player (jitter buffer)
// One turn's server timeline (response.done timing) as a stacked bar next to the TTFA.
const TIMING_PARTS = ["silence_wait", "asr", "llm", "tts", "send"];
function drawTiming(seg) {
  state.timings.push(seg);
  const bar = $("timing");
  bar.replaceChildren();
  const total = TIMING_PARTS.reduce((sum, k) => sum + Math.max(0, seg[k] || 0), 0) || 1;
  for (const k of TIMING_PARTS) {
    const ms = Math.max(0, seg[k] || 0);
    if (!ms) continue;
    const part = document.createElement("span");
    part.className = "seg seg-" + k;
    part.style.width = (100 * ms / total).toFixed(1) + "%";
    part.title = k + " " + Math.round(ms) + " ms";
    bar.append(part);
  }
  bar.title = TIMING_PARTS.map((k) => k + " " + Math.round(seg[k] || 0) + " ms").join(" · ");
}

class Player {
  constructor() {
    this.ctx = new AudioContext({ sampleRate: OUT_RATE, latencyHint: "interactive" });
    this.sources = new Set();
    this.nextTime = 0;
    this.itemId = null;
    this.itemStart = 0; // ctx time where the current item's audio started
    this.scheduledMs = 0;
  }
  push(itemId, pcmBytes) {
    const pcm = new Int16Array(pcmBytes.buffer, pcmBytes.byteOffset, pcmBytes.byteLength >> 1);
    const buf = this.ctx.createBuffer(1, pcm.length, OUT_RATE);
    const ch = buf.getChannelData(0);
    for (let i = 0; i < pcm.length; i++) ch[i] = pcm[i] / 32768;
    const now = this.ctx.currentTime;
    if (this.nextTime < now) this.nextTime = now + JITTER_S; // underrun: re-buffer
    if (itemId !== this.itemId) {
      this.itemId = itemId;
      this.itemStart = this.nextTime;
      this.scheduledMs = 0;
    }
    const src = this.ctx.createBufferSource();
    src.buffer = buf;
    src.connect(this.ctx.destination);
    src.start(this.nextTime);
    src.onended = () => this.sources.delete(src);
    this.sources.add(src);
    this.nextTime += buf.duration;
    this.scheduledMs += buf.duration * 1000;
  }
  playedMs() {
    if (this.itemId === null) return 0;
    const played = (this.ctx.currentTime - this.itemStart) * 1000;
    return Math.max(0, Math.min(played, this.scheduledMs));
  }
  // A suspected interruption: the context's clock stops, so what is scheduled waits (and
  // audio that arrives meanwhile queues behind it); resume() plays on from that sample.
  pause() {
    if (this.ctx.state === "running") this.ctx.suspend();
  }
  resume() {
    if (this.ctx.state === "suspended") this.ctx.resume();
  }
  flush() {
    const played = { itemId: this.itemId, ms: this.playedMs() };
    for (const src of this.sources) { try { src.stop(); } catch (e) { /* already ended */ } }
    this.sources.clear();
    this.nextTime = 0;
    this.itemId = null;
    this.resume(); // (a flush ends a pause: the next answer plays)
    return played;
  }
}

// ------------------------------------------------------------------ session
class Session {
  constructor(url, key) {
    this.url = url;
    this.key = key;
    this.lastSeq = 0;
    this.token = null;
    this.closing = false;
    this.player = new Player();
    this.speechStoppedAt = null;
    this.awaitingFirstAudio = false;
    this.assistantLine = null;
    this.bubbles = new Map(); // response id -> its bubble
    this.itemResponse = new Map(); // assistant item id -> response id
    this.muted = false;
  }
  // An answer cut short is marked "(interrupted)": cancelled by the server, or its audio
  // flushed while it played (the reply may already be complete on the server).
  markInterrupted(responseId) {
    const li = this.bubbles.get(responseId);
    if (!li || li.classList.contains("cancelled")) return;
    li.classList.remove("paused", "taken-back");
    li.classList.add("cancelled");
    state.interrupted++;
    $("interrupts").textContent = state.interrupted;
  }
  // The server paused the answer for speech over it (output_audio_buffer.paused), then took
  // the pause back (.resumed): the answer goes on, marked "(cut taken back)".
  markPaused(responseId, paused) {
    const li = this.bubbles.get(responseId);
    if (!li || li.classList.contains("cancelled")) return;
    li.classList.toggle("paused", paused);
    if (!paused) li.classList.add("taken-back");
  }
  protocols() {
    const p = ["realtime"];
    if (this.key) p.push("openai-insecure-api-key." + this.key);
    return p;
  }
  open(resume) {
    // a resume names the front end that owns the session (session.created's resume_query)
    const query = this.resumeQuery || "intent=resume";
    const url = resume ? this.url + (this.url.includes("?") ? "&" : "?") + query : this.url;
    const ws = new WebSocket(url, this.protocols());
    ws.binaryType = "arraybuffer";
    this.ws = ws;
    ws.onopen = () => {
      if (resume) {
        ws.send(JSON.stringify({ type: "session.resume", session_id: state.sessionId,
          resume_token: this.token, last_received_server_event_seq: this.lastSeq }));
      }
    };
    ws.onmessage = (m) => this.onEvent(JSON.parse(m.data));
    ws.onclose = (e) => this.onClose(e);
  }
  send(obj) {
    if (this.ws && this.ws.readyState === WebSocket.OPEN) this.ws.send(JSON.stringify(obj));
  }
  sendAudio(buf) {
    if (this.muted || !state.connected || this.ws.readyState !== WebSocket.OPEN) return;
    this.ws.send(buf);
    state.framesSent++;
  }
  onClose(e) {
    state.connected = false;
    if (this.closing || !this.token) { setStatus("disconnected"); return; }
    setStatus("reconnecting", "reconnecting");
    this.retries = (this.retries || 0) + 1;
    if (this.retries > 6) { setStatus("connection lost"); return; }
    setTimeout(() => this.open(true), Math.min(200 * 2 ** this.retries, 4000));
  }
  close() {
    this.closing = true;
    this.send({ type: "session.close" });
    setTimeout(() => this.ws.close(), 300);
    this.player.flush();
  }
  flushPlayer() {
    const cut = this.player.sources.size > 0; // audio still playing or queued
    const played = this.player.flush();
    state.flushes++;
    if (played.itemId) this.send({ type: "playback.ack", item_id: played.itemId, played_ms: played.ms });
    if (cut && played.itemId) this.markInterrupted(this.itemResponse.get(played.itemId));
  }
  onEvent(ev) {
    const seq = ev.server_event_seq || 0;
    if (seq && seq <= this.lastSeq) return; // replayed after a resume: already handled
    if (seq) this.lastSeq = seq;
    switch (ev.type) {
      case "session.created":
        state.sessionId = ev.session.id;
        this.token = ev.resume_token;
        this.resumeQuery = ev.resume_query || "intent=resume";
        $("session").textContent = ev.session.id;
        if (this.rtc) break; // the call request carried the session
        this.send({ type: "session.update", session: {
          output_modalities: ["audio"],
          audio: {
            input: { format: { type: "audio/pcm", rate: IN_RATE },
              turn_detection: { type: "server_vad", interrupt_mode: this.interruptMode } },
            output: { format: { type: "audio/pcm", rate: OUT_RATE } },
          },
        } });
        break;
      case "session.updated": {
        const td = ev.session.audio && ev.session.audio.input && ev.session.audio.input.turn_detection;
        this.interruptMode = td ? td.interrupt_mode : undefined;
        state.connected = true;
        this.retries = 0;
        setStatus("live", "live");
        break;
      }
      case "session.resumed":
        this.token = ev.resume_token;
        state.connected = true;
        state.resumes++;
        this.retries = 0;
        setStatus("live", "live");
        addLine("system", "reconnected (" + ev.replayed + " events replayed)");
        break;
      case "input_audio_buffer.speech_started":
        // Speech over the answer: the server judges it (confirm) and pauses, stops or lets
        // the answer go on; a server that judges immediately (no confirm) means a cut.
        if (this.player.sources.size && this.interruptMode !== "confirm") this.flushPlayer();
        break;
      case "output_audio_buffer.paused": // maybe an interruption: hold the answer here
        state.paused++;
        this.player.pause();
        this.markPaused(ev.response_id, true);
        break;
      case "output_audio_buffer.resumed": // it was not: play on from where it paused
        state.takenBack++;
        $("takenback").textContent = state.takenBack;
        this.player.resume();
        this.markPaused(ev.response_id, false);
        break;
      case "input_audio_buffer.speech_stopped":
        this.speechStoppedAt = performance.now();
        this.awaitingFirstAudio = true;
        break;
      case "conversation.item.input_audio_transcription.completed":
        if (ev.transcript) { state.userTranscripts.push(ev.transcript); addLine("user", ev.transcript); }
        break;
      case "response.created":
        this.assistantLine = addLine("assistant", "");
        this.bubbles.set(ev.response.id, this.assistantLine);
        break;
      case "response.output_audio.delta": {
        if (this.awaitingFirstAudio && this.speechStoppedAt !== null) {
          const ms = performance.now() - this.speechStoppedAt;
          state.ttfaMs.push(ms);
          $("ttfa").textContent = Math.round(ms) + " ms";
          this.awaitingFirstAudio = false;
        }
        this.itemResponse.set(ev.item_id, ev.response_id);
        const bin = atob(ev.delta);
        const bytes = new Uint8Array(bin.length);
        for (let i = 0; i < bin.length; i++) bytes[i] = bin.charCodeAt(i);
        this.player.push(ev.item_id, bytes);
        break;
      }
      case "response.output_audio_transcript.delta":
      case "response.output_text.delta":
        if (this.assistantLine) this.assistantLine.firstChild.textContent += ev.delta;
        break;
      case "output_audio_buffer.started": // WebRTC: the reply plays on the server's track
        state.audioStarted++;
        if (this.awaitingFirstAudio && this.speechStoppedAt !== null) {
          const ms = performance.now() - this.speechStoppedAt;
          state.ttfaMs.push(ms);
          $("ttfa").textContent = Math.round(ms) + " ms";
          this.awaitingFirstAudio = false;
        }
        break;
      case "output_audio_buffer.cleared": // WebRTC: the server flushed the reply's track
        state.audioCleared++;
        this.flushPlayer();
        if (ev.response_id) this.markInterrupted(ev.response_id);
        break;
      case "response.done": {
        const r = ev.response;
        state.responses.push(r.status);
        if (r.timing && r.timing.segments_ms) drawTiming(r.timing.segments_ms);
        $("turns").textContent = state.responses.length;
        if (this.assistantLine) {
          const text = this.assistantLine.firstChild.textContent;
          if (text) state.assistantTranscripts.push(text);
        }
        if (r.status === "cancelled") this.markInterrupted(r.id);
        this.assistantLine = null;
        break;
      }
      case "error":
        addLine("system", "error " + ev.error.code + ": " + ev.error.message);
        break;
      case "session.handover":
        // the server is draining for a deploy: the close that follows is resumed (onClose)
        // through the load balancer on another front end
        addLine("system", "moving to another server");
        break;
      case "session.resync_required":
        addLine("system", ev.type + (ev.reason ? ": " + ev.reason : ""));
        // front_end_lost, engine_restarted: the session goes on (its server or the engine
        // crashed; an answer in progress may be cut); any other reason ends it
        if (ev.reason !== "front_end_lost" && ev.reason !== "engine_restarted") this.closing = true;
        break;
      case "session.expired":
      case "session.closed":
      case "session.replaced":
        addLine("system", ev.type + (ev.reason ? ": " + ev.reason : ""));
        this.closing = true;
        break;
    }
  }
}

// ------------------------------------------------------------------ WebRTC
class RtcSession extends Session {
  constructor(url, key) {
    super(url, key);
    this.rtc = true;
    this.pc = null;
    this.dc = null;
    this.audio = null;
  }
  callsUrl() {
    const u = new URL(this.url.replace(/^ws/, "http"));
    return u.origin + "/v1/realtime/calls";
  }
  async start() {
    const stream = await navigator.mediaDevices.getUserMedia({
      audio: { channelCount: 1, echoCancellation: true, noiseSuppression: true, autoGainControl: true },
    });
    this.stream = stream;
    const pc = (this.pc = new RTCPeerConnection());
    this.audio = document.createElement("audio");
    this.audio.autoplay = true;
    pc.ontrack = (e) => { this.audio.srcObject = e.streams[0] || new MediaStream([e.track]); };
    stream.getTracks().forEach((t) => pc.addTrack(t, stream));
    const dc = (this.dc = pc.createDataChannel("oai-events"));
    dc.onmessage = (m) => this.onEvent(JSON.parse(m.data));
    dc.onclose = () => { state.connected = false; setStatus("disconnected"); };
    await pc.setLocalDescription(await pc.createOffer());
    await new Promise((resolve) => {  // no trickle: the offer carries every candidate
      if (pc.iceGatheringState === "complete") return resolve();
      pc.onicegatheringstatechange = () => pc.iceGatheringState === "complete" && resolve();
      setTimeout(resolve, 2000);
    });
    const form = new FormData();
    form.append("sdp", pc.localDescription.sdp);
    form.append("session", JSON.stringify({ type: "realtime", output_modalities: ["audio"],
      audio: { input: { turn_detection: { type: "server_vad", interrupt_mode: this.interruptMode } } } }));
    const headers = this.key ? { Authorization: "Bearer " + this.key } : {};
    const resp = await fetch(this.callsUrl(), { method: "POST", body: form, headers });
    if (resp.status !== 201) throw new Error("call refused: " + resp.status + " " + (await resp.text()));
    this.location = resp.headers.get("Location");
    await pc.setRemoteDescription({ type: "answer", sdp: await resp.text() });
    this.statsTimer = setInterval(() => this.pollStats(), 500);
    this.levelTimer = meterStream(stream);
  }
  async pollStats() {
    if (!this.pc) return;
    const stats = await this.pc.getStats();
    stats.forEach((r) => {
      if (r.type === "inbound-rtp" && r.kind === "audio") {
        state.rtcPacketsReceived = r.packetsReceived || 0;
        state.rtcAudioEnergy = r.totalAudioEnergy || 0;
        // what this browser's jitter buffer holds before it plays (mean ms per sample)
        if (r.jitterBufferEmittedCount) {
          state.rtcJitterBufferMs = (1000 * r.jitterBufferDelay) / r.jitterBufferEmittedCount;
          state.rtcJitterTargetMs = (1000 * r.jitterBufferTargetDelay) / r.jitterBufferEmittedCount;
        }
      }
      if (r.type === "outbound-rtp" && r.kind === "audio") state.framesSent = r.packetsSent || 0;
    });
  }
  send(obj) {
    if (this.dc && this.dc.readyState === "open") this.dc.send(JSON.stringify(obj));
  }
  setMuted(muted) {
    this.muted = muted;
    if (this.stream) this.stream.getAudioTracks().forEach((t) => { t.enabled = !muted; });
  }
  close() {
    this.closing = true;
    this.send({ type: "session.close" });
    clearInterval(this.statsTimer);
    if (this.levelTimer) this.levelTimer.stop();
    setTimeout(() => {
      if (this.pc) this.pc.close();
      if (this.stream) this.stream.getTracks().forEach((t) => t.stop());
    }, 300);
  }
}

function meterStream(stream) {  // the mic level meter in WebRTC mode (no worklet)
  const ctx = new AudioContext();
  const analyser = ctx.createAnalyser();
  ctx.createMediaStreamSource(stream).connect(analyser);
  const buf = new Float32Array(analyser.fftSize);
  const timer = setInterval(() => {
    analyser.getFloatTimeDomainData(buf);
    let sum = 0;
    for (const x of buf) sum += x * x;
    $("level").value = Math.min(1, Math.sqrt(sum / buf.length) * 4);
  }, 100);
  return { stop: () => { clearInterval(timer); ctx.close(); } };
}

// ------------------------------------------------------------------ mic
async function startMic(session) {
  const stream = await navigator.mediaDevices.getUserMedia({
    audio: { channelCount: 1, echoCancellation: true, noiseSuppression: true, autoGainControl: true },
  });
  const ctx = new AudioContext({ sampleRate: IN_RATE, latencyHint: "interactive" });
  await ctx.audioWorklet.addModule("worklet.js");
  const node = new AudioWorkletNode(ctx, "pcm16-capture");
  node.port.onmessage = (m) => {
    $("level").value = m.data.level;
    session.sendAudio(m.data.pcm);
  };
  ctx.createMediaStreamSource(stream).connect(node);
  return { stop: () => { stream.getTracks().forEach((t) => t.stop()); ctx.close(); } };
}

// ------------------------------------------------------------------ UI
function setStatus(text, cls) {
  const el = $("status");
  el.textContent = text;
  el.className = "status " + (cls || "");
}

function addLine(who, text) {
  const li = document.createElement("li");
  li.className = who;
  li.appendChild(document.createTextNode(text));
  $("log").appendChild(li);
  li.scrollIntoView({ block: "end" });
  return li;
}

let session = null;
let mic = null;

$("url").value = (location.protocol === "https:" ? "wss://" : "ws://") + (location.host || "127.0.0.1:8000") + "/v1/realtime";

$("connect").onclick = async () => {
  if (session) {
    session.close();
    if (mic) mic.stop();
    session = mic = null;
    $("connect").textContent = "Connect";
    $("mute").disabled = true;
    return;
  }
  const rtc = $("webrtc").checked;
  state.transport = rtc ? "webrtc" : "websocket";
  session = rtc ? new RtcSession($("url").value, $("key").value.trim())
    : new Session($("url").value, $("key").value.trim());
  // the session's interruption mode: confirm if ticked, else the server's (auto)
  session.interruptMode = $("confirm").checked ? "confirm" : "auto";
  await session.player.ctx.resume(); // user gesture: allow audio output
  setStatus("connecting");
  if (rtc) {
    try {
      await session.start();
    } catch (err) {
      addLine("system", "WebRTC call failed: " + err.message);
      setStatus("disconnected");
    }
  } else {
    session.open(false);
    try {
      mic = await startMic(session);
    } catch (err) {
      addLine("system", "microphone unavailable: " + err.message);
    }
  }
  $("connect").textContent = "Disconnect";
  $("mute").disabled = false;
};

$("mute").onclick = () => {
  if (!session) return;
  if (session.rtc) session.setMuted(!session.muted);
  else session.muted = !session.muted;
  $("mute").textContent = session.muted ? "Unmute mic" : "Mute mic";
};
