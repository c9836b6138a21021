//! The `ocr` model against images whose shape, not their bytes, asks for memory
//! (issue 27, finding 1): white PNGs of a few dozen bytes, 1×2000, 1×1000, 2000×1,
//! 1×1. rapidocr's preprocessing raises the short side to 30 px, pads to 8:1 and
//! scales the short side to 736, so sizes grow with the long side squared: before
//! the fix 1×2000 asked for a 10.8 GB buffer and kiln died of SIGABRT under an
//! address-space limit. The server here runs under such a limit (`RLIMIT_AS`,
//! as a container's memory limit acts); each image is answered on its own (a 400
//! naming `max_canvas_pixels`, or a result), the server lives, and its peak RSS
//! (VmHWM) grows by less than 200 MiB.

// Test support: a failure should fail the test loudly.
#![allow(clippy::unwrap_used)]

use kiln_client::{DataType, InferRequest, InputTensor};
use kiln_tests::Kiln;

/// A white 8-bit grayscale PNG (`w` × `h`): a few dozen bytes.
fn white_png(w: u32, h: u32) -> Vec<u8> {
    let mut out = Vec::new();
    let mut encoder = png::Encoder::new(&mut out, w, h);
    encoder.set_color(png::ColorType::Grayscale);
    encoder.set_depth(png::BitDepth::Eight);
    encoder.set_compression(png::Compression::High);
    let mut writer = encoder.write_header().unwrap();
    writer
        .write_image_data(&vec![255u8; (w * h) as usize])
        .unwrap();
    writer.finish().unwrap();
    out
}

fn request(png: &[u8]) -> InferRequest {
    InferRequest {
        model: "ocr".into(),
        inputs: vec![InputTensor {
            name: "IMAGE".into(),
            dtype: DataType::Bytes,
            shape: vec![1],
            data: kiln_worker_sdk::encode_bytes(&[png]).into(),
        }],
        ..Default::default()
    }
}

/// A `/proc/PID/status` field in bytes (VmHWM, VmSize).
fn status_bytes(pid: u32, field: &str) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let kb: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix(field))
        .and_then(|v| {
            v.trim_start_matches(':')
                .trim()
                .trim_end_matches("kB")
                .trim()
                .parse()
                .ok()
        })
        .unwrap();
    kb * 1024
}

/// Limits the address space of process `pid` to `bytes`.
fn limit_address_space(pid: u32, bytes: u64) {
    let limit = libc::rlimit {
        rlim_cur: bytes,
        rlim_max: bytes,
    };
    // SAFETY: prlimit(2) on a child this test started, with a valid new limit
    // and no old limit asked for.
    let rc = unsafe {
        libc::prlimit(
            pid as libc::pid_t,
            libc::RLIMIT_AS,
            &limit,
            std::ptr::null_mut(),
        )
    };
    assert_eq!(rc, 0, "prlimit: {}", std::io::Error::last_os_error());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn degenerate_images_are_answered_in_bounded_memory() {
    let mut kiln = Kiln::serve_examples(&["ocr-det", "ocr-cls", "ocr-rec", "ocr"]);
    let pid = kiln.pid();
    // Warm: an ordinary photo's size (its detector input 2016×1504), so the
    // peak below measures what the degenerate shapes add beyond any photo.
    let warm = kiln
        .client
        .infer_binary(&request(&white_png(2000, 1500)))
        .await;
    assert!(warm.is_ok(), "{warm:?}");
    // 2 GiB of address space beyond what the warm server maps: what the
    // unbounded pipeline asked for (10.8 GB at once) cannot be had.
    limit_address_space(pid, status_bytes(pid, "VmSize") + (2 << 30));
    let before = status_bytes(pid, "VmHWM");

    for (w, h) in [
        (1, 2000),
        (1, 1000),
        (2000, 1),
        (1, 1),
        (3, 2000),
        (2000, 30),
    ] {
        let png = white_png(w, h);
        assert!(png.len() < 256, "{w}×{h}: {} bytes", png.len());
        match kiln.client.infer_binary(&request(&png)).await {
            Ok(answer) => {
                let texts = answer.outputs.iter().find(|o| o.name == "texts").unwrap();
                assert_eq!(texts.shape, vec![0], "{w}×{h}: a white image has no text");
            }
            Err(err) => {
                assert_eq!(err.status(), Some(400), "{w}×{h}: {err}");
                assert!(
                    err.to_string().contains("max_canvas_pixels"),
                    "{w}×{h}: {err}"
                );
            }
        }
        println!(
            "{w}×{h}: peak RSS +{} MiB",
            status_bytes(pid, "VmHWM").saturating_sub(before) >> 20
        );
        assert!(
            kiln.exit_within(std::time::Duration::ZERO).is_none(),
            "{w}×{h} took the server down; its log:\n{}",
            kiln.log()
        );
    }
    let growth = status_bytes(pid, "VmHWM").saturating_sub(before);
    println!("peak RSS grew by {} MiB", growth >> 20);
    assert!(growth < 200 << 20, "peak RSS grew by {} MiB", growth >> 20);

    // The server goes on serving ordinary images.
    let after = kiln
        .client
        .infer_binary(&request(&white_png(640, 480)))
        .await;
    assert!(after.is_ok(), "{after:?}");
}
