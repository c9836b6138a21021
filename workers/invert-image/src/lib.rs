//! `invert-image`: UINT8 image `image` [H, W, C] → `inverted` = 255 − v. It does not
//! batch (`max_batch_size` 0): every request is one image of any size.

use kiln_worker_sdk::{
    export_worker, Batch, BatcherKind, DataType, Params, TensorSpec, Worker, WorkerError,
    WorkerInfo,
};

/// The invert-image worker.
pub struct InvertImage;

impl Worker for InvertImage {
    fn init(_params: Params<'_>) -> Result<Self, WorkerError> {
        Ok(InvertImage)
    }

    fn info(&self) -> WorkerInfo {
        WorkerInfo {
            inputs: vec![TensorSpec::new("image", DataType::Uint8, &[-1, -1, -1])].into(),
            outputs: vec![TensorSpec::new("inverted", DataType::Uint8, &[-1, -1, -1])].into(),
            max_batch_size: 0,
            batcher: BatcherKind::Soft,
            allow_ragged_batch: true,
        }
    }

    fn run(&mut self, batch: &mut Batch<'_, '_>) -> Result<(), WorkerError> {
        let input = batch.input(0)?;
        let mut output = batch.output(0)?;
        let out = output.allocate(input.shapes())?;
        for (o, v) in out.iter_mut().zip(input.bytes()) {
            *o = 255 - v;
        }
        Ok(())
    }
}

export_worker!(InvertImage);

#[cfg(test)]
mod tests {
    use super::*;
    use kiln_worker_sdk::testing::{Harness, TestTensor};

    #[test]
    fn inverts_every_pixel() {
        let mut h = Harness::start::<InvertImage>(&[]).unwrap();
        let pixels: Vec<u8> = (0..12).map(|v| v * 20).collect();
        let img = vec![TestTensor::new(
            "image",
            DataType::Uint8,
            &[2, 2, 3],
            &pixels,
        )];
        let out = h.run(&[img]).unwrap();
        let want: Vec<u8> = pixels.iter().map(|v| 255 - v).collect();
        assert_eq!(out[0][0].data, want);
        assert_eq!(out[0][0].shape.dims(), &[2, 2, 3]);
    }
}
