// Mic capture: the AudioContext runs at 16 kHz (the browser resamples the mic), this
// processor converts float samples to PCM16 and posts 20 ms frames plus a level for the meter.
class Pcm16Capture extends AudioWorkletProcessor {
  constructor() {
    super();
    this.frame = new Int16Array(Math.round(sampleRate / 50)); // 20 ms
    this.fill = 0;
    this.peak = 0;
  }
  process(inputs) {
    const channel = inputs[0] && inputs[0][0];
    if (!channel) return true;
    for (let i = 0; i < channel.length; i++) {
      const s = Math.max(-1, Math.min(1, channel[i]));
      this.peak = Math.max(this.peak, Math.abs(s));
      this.frame[this.fill++] = s < 0 ? s * 0x8000 : s * 0x7fff;
      if (this.fill === this.frame.length) {
        const out = this.frame.slice();
        this.port.postMessage({ pcm: out.buffer, level: this.peak }, [out.buffer]);
        this.fill = 0;
        this.peak = 0;
      }
    }
    return true;
  }
}
registerProcessor("pcm16-capture", Pcm16Capture);
