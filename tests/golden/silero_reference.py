"""Reference speech probabilities of Silero VAD on many synthetic audio streams.

Generates S deterministic synthetic audio streams (16 kHz, C chunks of 512 samples,
float32 in [-1, 1]) and runs each stream alone through the reference onnxruntime
Python package, in order, chunk by chunk with batch 1, carrying the LSTM state from
chunk to chunk (initial state zeros [2, 1, 128], sr = 16000). It is the reference
for serving Silero statefully: a server that keeps each stream's state and batches
chunks of many streams together must give the same probabilities.

The streams differ from each other and vary over time: voiced "syllables" (the
harmonics of a gliding pitch shaped by moving vowel formants), mixtures of steady
tones with amplitude modulation, noise bursts and silences, each with per-stream
random parameters. The LSTM state matters on them: meta.json reports how far the
probabilities move when the state is reset to zeros before every chunk instead.

Context: by default (`--context 0`) each call feeds the model the 512-sample chunk
alone, [1, 512]. Silero VAD v5+ expects each call to start with the last 64 samples
of the previous chunk ([1, 576]; silero-vad's own Python wrapper does this): with
`--context 64` the script does that, and the probabilities span 0..1 (without the
context the model answers mostly below 0.5). Either way, inputs.f32 holds exactly
what each call fed as `input`: send its rows.

Usage (with the venv of scripts/setup-python):

    .cache/venv/bin/python tests/golden/silero_reference.py MODEL OUT_DIR \\
        [--streams 64] [--chunks 40] [--seed 7] [--context 0|64]

Writes, all raw little-endian float32, C order (S streams, C chunks, N = 512 + context):

    OUT_DIR/audio.f32        [S, C, 512]  the audio chunks
    OUT_DIR/inputs.f32       [S, C, N]    the model's `input` of each call (equal to
                                          audio.f32 when the context is 0)
    OUT_DIR/probs.f32        [S, C]       speech probability of each chunk (state carried)
    OUT_DIR/final_state.f32  [S, 2, 128]  each stream's state after its last chunk
                                          (stream-first: the model's [2, 1, 128] with the
                                          batch axis moved to the front)
    OUT_DIR/meta.json        the arguments, shapes and file names, the onnxruntime
                             version, and "stateful_vs_reset_max_abs_diff" (and _mean_):
                             the largest (mean) |p_carried - p_reset| over every chunk,
                             where p_reset is the probability with the state reset to
                             zeros before each chunk (also printed)

Stream s uses numpy's default_rng([seed, s]): the same arguments give the same
audio, and a stream's audio does not depend on how many streams are generated.
"""

import argparse
import json
import pathlib

import numpy as np
import onnxruntime as ort

RATE = 16000
CHUNK = 512
STATE_SHAPE = (2, 1, 128)


# Formants (F1, F2, F3 in Hz) of a few vowels: a, i, u, e, o, ae.
VOWELS = np.array([[730, 1090, 2440], [270, 2290, 3010], [300, 870, 2240],
                   [530, 1840, 2480], [570, 840, 2410], [660, 1720, 2410]], float)


def syllables(rng, t):
    """Voiced speech-like sound: the harmonics of a gliding pitch shaped by vowel
    formants that move from syllable to syllable, under a syllable envelope."""
    n = len(t)
    f0 = rng.uniform(90, 240) * (1 + 0.2 * np.sin(2 * np.pi * rng.uniform(0.5, 3) * t + rng.uniform(0, 2 * np.pi)))
    phase = 2 * np.pi * np.cumsum(f0) / RATE
    rate = rng.uniform(3, 6)  # syllables per second
    position = t * rate
    index = np.floor(position).astype(int)
    vowels = VOWELS[rng.integers(0, len(VOWELS), index[-1] + 2)] * rng.uniform(0.9, 1.15)
    glide = (0.5 - 0.5 * np.cos(np.pi * (position - index)))[:, None]
    formants = vowels[index] * (1 - glide) + vowels[index + 1] * glide
    voiced = np.zeros(n)
    for k in range(1, 60):
        freq = k * f0
        gain = sum(weight / (1 + ((freq - formants[:, j]) / width) ** 2)
                   for j, (weight, width) in enumerate(((1.0, 80), (0.6, 100), (0.3, 140))))
        voiced += gain * (freq < RATE / 2 - 500) * np.sin(k * phase)
    envelope = np.clip(np.sin(2 * np.pi * rate * t + rng.uniform(0, 2 * np.pi)), 0, None) ** rng.uniform(0.5, 1.5)
    return voiced / (np.abs(voiced).max() + 1e-9) * envelope


def tones(rng, t):
    """A mixture of steady tones with slow amplitude modulation."""
    mix = np.zeros_like(t)
    for _ in range(rng.integers(2, 5)):
        freq = rng.uniform(200, 3000)
        depth = rng.uniform(0.2, 1.0)
        am = 1 - depth * 0.5 * (1 + np.sin(2 * np.pi * rng.uniform(0.3, 8) * t + rng.uniform(0, 2 * np.pi)))
        mix += rng.uniform(0.2, 1.0) * am * np.sin(2 * np.pi * freq * t + rng.uniform(0, 2 * np.pi))
    return mix / 2


def bursts(rng, n):
    """Noise bursts of random length, loudness and colour at random places."""
    out = np.zeros(n)
    for _ in range(rng.integers(2, 8)):
        length = min(n, int(rng.integers(RATE // 50, RATE // 3)))
        start = int(rng.integers(0, max(1, n - length)))
        noise = rng.normal(0, 1, length)
        if rng.random() < 0.5:  # low-passed ("brown-ish") noise
            noise = np.cumsum(noise)
            noise -= np.linspace(noise[0], noise[-1], length)
            noise /= np.abs(noise).max() + 1e-9
        window = np.hanning(length)
        out[start:start + length] += rng.uniform(0.05, 0.6) * window * noise
    return out


def segments(rng, n):
    """A gate that switches between sound (1) and silence (0) every 0.1–0.8 s, smoothed."""
    gate = np.zeros(n)
    pos, on = 0, rng.random() < 0.5
    while pos < n:
        length = int(rng.uniform(0.1, 0.8) * RATE)
        gate[pos:pos + length] = 1.0 if on else 0.0
        pos += length
        on = not on
    ramp = np.hanning(801)
    return np.convolve(np.pad(gate, 400, mode="edge"), ramp / ramp.sum(), mode="valid")


def stream(seed, index, chunks):
    """Stream `index`'s audio: [chunks, 512] float32 in [-1, 1]."""
    rng = np.random.default_rng([seed, index])
    n = chunks * CHUNK
    t = np.arange(n) / RATE
    voice_gate = segments(rng, n)
    tone_gate = segments(rng, n)
    audio = (
        rng.uniform(0.2, 0.7) * syllables(rng, t) * voice_gate
        + rng.uniform(0.0, 0.4) * tones(rng, t) * tone_gate
        + bursts(rng, n)
        + rng.normal(0, rng.uniform(0.001, 0.02), n)
    )
    return np.clip(audio, -1.0, 1.0).astype(np.float32).reshape(chunks, CHUNK)


def model_inputs(chunks, context):
    """What each call feeds the model: the chunk, after the last `context` samples of
    the previous chunk (zeros before the first): [C, context + 512]."""
    if context == 0:
        return chunks
    previous = np.concatenate([np.zeros((1, context), np.float32), chunks[:-1, -context:]])
    return np.concatenate([previous, chunks], axis=1)


def run(session, inputs, carry):
    """Per-call probabilities of one stream, and its final state; `carry=False` resets
    the state to zeros before every call."""
    state = np.zeros(STATE_SHAPE, np.float32)
    sr = np.array(RATE, np.int64)
    probs = np.empty(len(inputs), np.float32)
    for i, x in enumerate(inputs):
        if not carry:
            state = np.zeros(STATE_SHAPE, np.float32)
        prob, state = session.run(None, {"input": x[None], "state": state, "sr": sr})
        probs[i] = prob[0, 0]
    return probs, state


def save(array, path):
    np.ascontiguousarray(array, dtype="<f4").tofile(path)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", type=pathlib.Path, help="Silero VAD's model.onnx")
    parser.add_argument("out_dir", type=pathlib.Path)
    parser.add_argument("--streams", type=int, default=64)
    parser.add_argument("--chunks", type=int, default=40)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--context", type=int, default=0, choices=[0, 64],
                        help="samples of the previous chunk fed before each chunk (64: as silero-vad's own wrapper)")
    args = parser.parse_args()
    if args.streams < 1 or args.chunks < 1:
        parser.error("--streams and --chunks must be at least 1")
    width = args.context + CHUNK

    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    options.inter_op_num_threads = 1
    session = ort.InferenceSession(str(args.model), options, providers=["CPUExecutionProvider"])

    audio = np.stack([stream(args.seed, s, args.chunks) for s in range(args.streams)])
    inputs = np.stack([model_inputs(chunks, args.context) for chunks in audio])
    probs = np.empty((args.streams, args.chunks), np.float32)
    states = np.empty((args.streams, 2, 128), np.float32)
    diffs = np.empty((args.streams, args.chunks), np.float32)
    for s in range(args.streams):
        probs[s], state = run(session, inputs[s], carry=True)
        states[s] = state[:, 0, :]
        reset, _ = run(session, inputs[s], carry=False)
        diffs[s] = np.abs(probs[s] - reset)
    diff = float(diffs.max())

    out = args.out_dir
    out.mkdir(parents=True, exist_ok=True)
    save(audio, out / "audio.f32")
    save(inputs, out / "inputs.f32")
    save(probs, out / "probs.f32")
    save(states, out / "final_state.f32")
    meta = {
        "model": str(args.model),
        "onnxruntime": ort.__version__,
        "streams": args.streams,
        "chunks": args.chunks,
        "seed": args.seed,
        "sample_rate": RATE,
        "chunk_samples": CHUNK,
        "context": args.context,
        "files": {
            "audio": {"file": "audio.f32", "datatype": "FP32", "shape": [args.streams, args.chunks, CHUNK]},
            "inputs": {"file": "inputs.f32", "datatype": "FP32", "shape": [args.streams, args.chunks, width]},
            "probs": {"file": "probs.f32", "datatype": "FP32", "shape": [args.streams, args.chunks]},
            "final_state": {"file": "final_state.f32", "datatype": "FP32", "shape": [args.streams, 2, 128]},
        },
        "stateful_vs_reset_max_abs_diff": diff,
        "stateful_vs_reset_mean_abs_diff": float(diffs.mean()),
        "probs_min": float(probs.min()),
        "probs_max": float(probs.max()),
        "speech_fraction": float((probs > 0.5).mean()),
    }
    (out / "meta.json").write_text(json.dumps(meta, indent=1))
    print(f"silero_reference: {args.streams} streams x {args.chunks} chunks -> {out}; "
          f"probabilities {meta['probs_min']:.4f}..{meta['probs_max']:.4f}, "
          f"{100 * meta['speech_fraction']:.1f}% above 0.5; "
          f"stateful_vs_reset_max_abs_diff {diff:.4f} (mean {diffs.mean():.4f})")


if __name__ == "__main__":
    main()
