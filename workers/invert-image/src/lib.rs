//! `invert-image`: UINT8 image `image` [H, W, C] → `inverted` = 255 − v. By default
//! it does not batch (`max_batch_size` 0): every request is one image of any size.
//! With the load parameter `max_batch_size` N > 0 it batches up to N images
//! ([1, H, W, C] each; images of different sizes share a batch, the work being
//! per pixel): the `invert-video` model (examples/models) serves the frames of
//! many WebSocket sessions so, as the AMD Inference Server's invert_video does.

use kiln_worker_sdk::{
    export_worker, Batch, BatcherKind, DataType, ParamKind, ParamSpec, Params, TensorSpec, Worker,
    WorkerError, WorkerInfo,
};

/// The invert-image worker.
pub struct InvertImage {
    max_batch_size: u32,
}

impl Worker for InvertImage {
    const PARAMETERS: &'static [ParamSpec] = &[ParamSpec::load(
        "max_batch_size",
        ParamKind::Int { min: 0, max: 256 },
    )];

    fn init(params: Params<'_>) -> Result<Self, WorkerError> {
        let max_batch_size = params
            .int("max_batch_size")
            .map_err(WorkerError::new)?
            .unwrap_or(0);
        let max_batch_size = u32::try_from(max_batch_size)
            .map_err(|_| WorkerError::new("max_batch_size must be 0 to 256"))?;
        Ok(InvertImage { max_batch_size })
    }

    fn info(&self) -> WorkerInfo {
        WorkerInfo {
            inputs: vec![TensorSpec::new("image", DataType::Uint8, &[-1, -1, -1])].into(),
            outputs: vec![TensorSpec::new("inverted", DataType::Uint8, &[-1, -1, -1])].into(),
            max_batch_size: self.max_batch_size,
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

    #[test]
    fn batches_images_of_different_sizes() {
        let mut h = Harness::start::<InvertImage>(&[("max_batch_size", "4")]).unwrap();
        assert_eq!(h.info().max_batch_size, 4);
        let a = vec![TestTensor::new(
            "image",
            DataType::Uint8,
            &[1, 1, 2, 3],
            &[0u8, 1, 2, 3, 4, 5],
        )];
        let b = vec![TestTensor::new(
            "image",
            DataType::Uint8,
            &[1, 2, 1, 3],
            &[9u8; 6],
        )];
        let out = h.run(&[a, b]).unwrap();
        assert_eq!(out[0][0].data, vec![255, 254, 253, 252, 251, 250]);
        assert_eq!(out[0][0].shape.dims(), &[1, 1, 2, 3]);
        assert_eq!(out[1][0].data, vec![246; 6]);
        assert_eq!(out[1][0].shape.dims(), &[1, 2, 1, 3]);
    }
}
