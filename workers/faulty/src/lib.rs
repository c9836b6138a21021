//! `faulty`: a worker for testing failure handling. INT32 `INPUT0` [-1] is copied to
//! `OUTPUT0`, except that a batch holding the value -1 panics and one holding -2
//! returns an error; one holding -3 takes 1 s (a slow worker, to test overload).
//! A request holding -7 is failed alone as invalid (400), one holding -8 alone as a
//! worker fault (500): the rest of the batch is answered. A batch holding -6 asks the
//! host for an output of an impossible size (the host must refuse, not abort).
//! Two values end the process, as a plugin's memory bug or failed assertion in C
//! would: a batch holding -4 aborts it (`std::process::abort`, SIGABRT), one
//! holding -5 writes through a pointer to an unmapped address (SIGSEGV). The SDK
//! cannot catch either: only `isolation = "process"` keeps the server up.
//! `fail_init=true` makes `init` fail and `fail_acquire=true` makes `acquire` fail (to
//! test load rollback). Every lifecycle step is logged, so tests can read the order
//! in the server's log.

use kiln_worker_sdk::{
    export_worker, Batch, BatcherKind, DataType, ParamKind, ParamSpec, Params, RequestError,
    TensorSpec, Worker, WorkerError, WorkerInfo,
};

/// The faulty worker.
pub struct Faulty {
    fail_acquire: bool,
}

impl Worker for Faulty {
    const PARAMETERS: &'static [ParamSpec] = &[
        ParamSpec::load("fail_init", ParamKind::Bool),
        ParamSpec::load("fail_acquire", ParamKind::Bool),
    ];

    fn init(params: Params<'_>) -> Result<Self, WorkerError> {
        if params.bool("fail_init")?.unwrap_or(false) {
            return Err("init failed as asked (fail_init=true)".into());
        }
        log::info!("faulty: init");
        Ok(Faulty {
            fail_acquire: params.bool("fail_acquire")?.unwrap_or(false),
        })
    }

    fn allocate(&mut self, batch_size: usize) -> Result<(), WorkerError> {
        log::info!("faulty: allocate {batch_size}");
        Ok(())
    }

    fn acquire(&mut self) -> Result<(), WorkerError> {
        if self.fail_acquire {
            return Err("acquire failed as asked (fail_acquire=true)".into());
        }
        log::info!("faulty: acquire");
        Ok(())
    }

    fn release(&mut self) -> Result<(), WorkerError> {
        log::info!("faulty: release");
        Ok(())
    }

    fn deallocate(&mut self) -> Result<(), WorkerError> {
        log::info!("faulty: deallocate");
        Ok(())
    }

    fn info(&self) -> WorkerInfo {
        WorkerInfo {
            inputs: vec![TensorSpec::new("INPUT0", DataType::Int32, &[-1])].into(),
            outputs: vec![TensorSpec::new("OUTPUT0", DataType::Int32, &[-1])].into(),
            max_batch_size: 64,
            batcher: BatcherKind::Soft,
            allow_ragged_batch: true,
        }
    }

    fn run(&mut self, batch: &mut Batch<'_, '_>) -> Result<(), WorkerError> {
        let input = batch.input(0)?;
        let values = input.as_slice::<i32>()?;
        if values.contains(&-1) {
            panic!("faulty worker saw -1");
        }
        if values.contains(&-4) {
            log::error!("faulty: -4, aborting the process");
            std::process::abort();
        }
        if values.contains(&-5) {
            log::error!("faulty: -5, writing to an unmapped address");
            segfault();
        }
        if values.contains(&-2) {
            // An event of the worker's on the batch's span (when it is traced).
            kiln_worker_sdk::trace::event("failing on purpose", &[("value", "-2")]);
            return Err("faulty worker saw -2".into());
        }
        if values.contains(&-3) {
            std::thread::sleep(std::time::Duration::from_millis(1000));
        }
        let mut start = 0;
        for (request, shape) in input.shapes().iter().enumerate() {
            let end = start + shape.element_count();
            let mine = &values[start..end];
            if mine.contains(&-7) {
                batch.fail(request, RequestError::invalid("faulty worker refused -7"))?;
            } else if mine.contains(&-8) {
                batch.fail(
                    request,
                    RequestError::internal("faulty worker failed on -8"),
                )?;
            }
            start = end;
        }
        let mut output = batch.output(0)?;
        if values.contains(&-6) {
            output.allocate_bytes(input.shapes(), usize::MAX / 2)?;
        }
        output
            .allocate_as::<i32>(input.shapes())?
            .copy_from_slice(values);
        Ok(())
    }
}

/// Writes through a pointer to the first page, which is never mapped: a real
/// invalid memory access, answered by the kernel with SIGSEGV.
fn segfault() {
    let unmapped = std::ptr::without_provenance_mut::<u8>(8);
    // SAFETY: none; this is the defect the worker exists to have. The address is
    // non-null and aligned, so the write is emitted and faults.
    unsafe { std::ptr::write_volatile(unmapped, 1) };
}

impl Drop for Faulty {
    fn drop(&mut self) {
        log::info!("faulty: destroy");
    }
}

export_worker!(Faulty);

#[cfg(test)]
mod tests {
    use super::*;
    use kiln_worker_sdk::testing::{Harness, TestTensor};

    #[test]
    fn panic_becomes_error_and_instance_recovers() {
        let mut h = Harness::start::<Faulty>(&[]).unwrap();
        let bad = vec![TestTensor::new(
            "INPUT0",
            DataType::Int32,
            &[1, 2],
            &[5i32, -1],
        )];
        let err = h.run(&[bad]).unwrap_err();
        assert!(err.0.contains("panicked"), "{err}");
        h.restart().unwrap();
        let good = vec![TestTensor::new(
            "INPUT0",
            DataType::Int32,
            &[1, 2],
            &[5i32, 6],
        )];
        assert_eq!(h.run(&[good]).unwrap()[0][0].values::<i32>(), vec![5, 6]);
    }

    #[test]
    fn requests_fail_alone_with_their_class() {
        use kiln_worker_sdk::RequestErrorKind;
        let mut h = Harness::start::<Faulty>(&[]).unwrap();
        let tensor = |v: i32| {
            (
                vec![TestTensor::new("INPUT0", DataType::Int32, &[1, 1], &[v])],
                Vec::new(),
            )
        };
        let out = h
            .run_requests(&[tensor(7), tensor(-7), tensor(-8), tensor(8)])
            .unwrap();
        assert_eq!(out[0].as_ref().unwrap()[0].values::<i32>(), vec![7]);
        assert_eq!(out[1].as_ref().unwrap_err().kind, RequestErrorKind::Invalid);
        assert_eq!(
            out[2].as_ref().unwrap_err().kind,
            RequestErrorKind::Internal
        );
        assert_eq!(out[3].as_ref().unwrap()[0].values::<i32>(), vec![8]);
    }

    #[test]
    fn an_impossible_output_size_is_an_error() {
        let mut h = Harness::start::<Faulty>(&[]).unwrap();
        let huge = vec![TestTensor::new(
            "INPUT0",
            DataType::Int32,
            &[1, 1],
            &[-6i32],
        )];
        let err = h.run(&[huge]).unwrap_err();
        assert!(err.0.contains("cannot allocate"), "{err}");
    }

    #[test]
    fn error_and_failed_init() {
        let mut h = Harness::start::<Faulty>(&[]).unwrap();
        let bad = vec![TestTensor::new(
            "INPUT0",
            DataType::Int32,
            &[1, 1],
            &[-2i32],
        )];
        assert_eq!(h.run(&[bad]).unwrap_err().0, "faulty worker saw -2");
        assert!(Harness::start::<Faulty>(&[("fail_init", "true")]).is_err());
        assert!(Harness::start::<Faulty>(&[("fail_acquire", "true")]).is_err());
    }
}
