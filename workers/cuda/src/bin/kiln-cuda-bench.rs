//! kiln-cuda-bench: the cuda worker's GPU path alone, no server, against the CPU
//! code it replaces — the `invert-image` worker's loop and a plain matrix–vector
//! loop — on the same data, checking the GPU's answers. Sweeps streams (1 = no
//! overlap of copies and compute) and chunk sizes, and splits the GPU path's time:
//! the kernel alone on device-resident data, and the bus alone (pinned upload and
//! download, no CPU copy). One JSON object per line.
//!
//! ```text
//! kiln-cuda-bench [--seconds 2]
//! ```

use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use kiln_buffers::cuda::{self, Staging, StagingKind};
use kiln_worker_cuda::config::{Config, Kernel};
use kiln_worker_cuda::kernels::Compiled;
use kiln_worker_cuda::CudaWorker;

/// Runs `f` for `seconds` after 3 warm-up calls; returns calls per second.
fn rate(seconds: f64, mut f: impl FnMut() -> anyhow::Result<()>) -> anyhow::Result<f64> {
    for _ in 0..3 {
        f()?;
    }
    let (start, mut calls) = (Instant::now(), 0u64);
    while start.elapsed() < Duration::from_secs_f64(seconds) {
        f()?;
        calls += 1;
    }
    Ok(calls as f64 / start.elapsed().as_secs_f64())
}

fn config(kernel: Kernel, streams: usize, chunk_bytes: usize, chunk_rows: usize) -> Config {
    Config {
        kernel,
        device: 0,
        streams,
        chunk_bytes,
        chunk_rows,
        rows: 256,
        cols: 256,
        max_batch_size: 64,
        library_dir: None,
    }
}

fn report(case: &str, path: &str, per_second: f64, bytes: usize, extra: &str) {
    println!(
        "{{\"case\": \"{case}\", \"path\": \"{path}\", \"per_s\": {per_second:.1}, \
         \"ms\": {:.3}, \"gb_per_s\": {:.2}{extra}}}",
        1e3 / per_second,
        per_second * bytes as f64 / 1e9
    );
}

fn invert(seconds: f64) -> anyhow::Result<()> {
    let image: Vec<u8> = (0..1080 * 1920 * 3).map(|v: usize| (v * 7) as u8).collect();
    let mut out = vec![0u8; image.len()];
    let case = "invert-image 1080x1920x3";
    // The CPU worker's loop (workers/invert-image).
    let cpu = rate(seconds, || {
        for (o, v) in out.iter_mut().zip(&image) {
            *o = 255 - v;
        }
        Ok(())
    })?;
    let want = out.clone();
    report(
        case,
        "cpu (invert-image loop, 1 thread)",
        cpu,
        image.len(),
        "",
    );
    for (streams, chunk) in [
        (1, 6 << 20),
        (1, 1 << 20),
        (2, 1 << 20),
        (2, 256 << 10),
        (4, 512 << 10),
    ] {
        let mut gpu = CudaWorker::open(config(Kernel::InvertImage, streams, chunk, 1))
            .map_err(|e| anyhow::anyhow!("{e}"))?;
        out.fill(0);
        let per_s = rate(seconds, || {
            gpu.invert_bytes(&image, &mut out)
                .map_err(|e| anyhow::anyhow!("{e}"))
        })?;
        if out != want {
            bail!("GPU inversion differs from the CPU's");
        }
        let extra = format!(", \"streams\": {streams}, \"chunk_bytes\": {chunk}");
        report(case, "gpu", per_s, image.len(), &extra);
    }
    parts(
        seconds,
        case,
        (image.len(), image.len()),
        Kernel::InvertImage,
    )
}

/// The GPU path's parts for one batch of `bytes` in and out: the kernel alone on
/// device-resident data, then the bus alone (pinned → device → pinned).
fn parts(
    seconds: f64,
    case: &str,
    (bytes, out_bytes): (usize, usize),
    kernel: Kernel,
) -> anyhow::Result<()> {
    let ctx = cuda::open(0, &cuda::Libraries::default())?;
    let stream = ctx.new_stream()?;
    let compiled = Compiled::new(&ctx, kernel)?;
    let mut up = Staging::new(&ctx, bytes, StagingKind::Upload)?;
    let mut down = Staging::new(&ctx, bytes.max(out_bytes), StagingKind::Download)?;
    up.host.as_mut_slice().fill(1);
    let (a, b) = (up.device.ptr(), down.device.ptr());
    let kernel_only = rate(seconds, || {
        match kernel {
            Kernel::InvertImage => compiled.invert(&stream, a, b, bytes)?,
            // 64 matrices of 256x256 and their vectors: the bench's batch.
            Kernel::Matvec => compiled.matvec(&stream, (a, a, b), 64, 256, 256)?,
        }
        stream.synchronize()?;
        Ok(())
    })?;
    report(
        case,
        "gpu kernel alone (device-resident, + launch and sync)",
        kernel_only,
        bytes,
        "",
    );
    let bus = rate(seconds, || {
        up.upload(&stream, bytes)?;
        down.download(&stream, out_bytes)?;
        stream.synchronize()?;
        Ok(())
    })?;
    report(
        case,
        "bus alone (pinned upload + download of the batch)",
        bus,
        bytes,
        "",
    );
    Ok(())
}

fn matvec(seconds: f64) -> anyhow::Result<()> {
    let (batch, rows, cols) = (64usize, 256usize, 256usize);
    let a: Vec<f32> = (0..batch * rows * cols)
        .map(|k| (k % 97) as f32 / 97.0 - 0.5)
        .collect();
    let x: Vec<f32> = (0..batch * cols)
        .map(|k| (k % 89) as f32 / 89.0 - 0.5)
        .collect();
    let mut y = vec![0f32; batch * rows];
    let case = "matvec 64 x (256x256 . 256) FP32";
    let bytes = (a.len() + x.len() + y.len()) * 4;
    let cpu = rate(seconds, || {
        for b in 0..batch {
            for i in 0..rows {
                let row = &a[(b * rows + i) * cols..][..cols];
                let v = &x[b * cols..][..cols];
                y[b * rows + i] = row.iter().zip(v).map(|(p, q)| p * q).sum();
            }
        }
        Ok(())
    })?;
    let want = y.clone();
    let flops = 2.0 * (batch * rows * cols) as f64;
    let gflops = |per_s: f64| format!(", \"gflop_per_s\": {:.2}", per_s * flops / 1e9);
    report(case, "cpu (plain loop, 1 thread)", cpu, bytes, &gflops(cpu));
    let (ab, xb): (&[u8], &[u8]) = (bytemuck::cast_slice(&a), bytemuck::cast_slice(&x));
    for (streams, chunk_rows) in [(1, 64), (1, 16), (2, 16), (2, 8), (4, 8)] {
        let mut gpu = CudaWorker::open(config(Kernel::Matvec, streams, 4096, chunk_rows))
            .map_err(|e| anyhow::anyhow!("{e}"))?;
        let mut out = vec![0u8; y.len() * 4];
        let per_s = rate(seconds, || {
            gpu.matvec_bytes(batch, ab, xb, &mut out)
                .map_err(|e| anyhow::anyhow!("{e}"))
        })?;
        for (k, w) in want.iter().enumerate() {
            let got: f32 = bytemuck::pod_read_unaligned(&out[k * 4..k * 4 + 4]);
            if (got - w).abs() > 1e-3 * (1.0 + w.abs()) {
                bail!("GPU product {k} is {got}, the CPU's {w}");
            }
        }
        let extra = format!(
            ", \"streams\": {streams}, \"chunk_rows\": {chunk_rows}{}",
            gflops(per_s)
        );
        report(case, "gpu", per_s, bytes, &extra);
    }
    parts(
        seconds,
        case,
        ((a.len() + x.len()) * 4, y.len() * 4),
        Kernel::Matvec,
    )
}

fn main() -> anyhow::Result<()> {
    let mut seconds = 2.0;
    let mut args = std::env::args().skip(1);
    while let Some(flag) = args.next() {
        match flag.as_str() {
            "--seconds" => {
                seconds = args.next().context("--seconds needs a value")?.parse()?;
            }
            other => bail!("unknown flag {other}"),
        }
    }
    let device = kiln_worker_cuda::probe().map_err(|e| anyhow::anyhow!("{e}"))?;
    println!("{{\"device\": \"{device}\"}}");
    invert(seconds)?;
    matvec(seconds)
}
