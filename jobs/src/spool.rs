//! Where a submission's validated requests wait until the whole body is read
//! and checked, so that [`crate::JobQueue::enqueue`] stores all of them or none
//! without the body held in memory: in memory up to [`IN_MEMORY`] bytes, then
//! in an unlinked file in the operator's folder (the embedded store's folder, or
//! the system's temporary folder), read back as the store takes them.

use std::fs::File;
use std::io::{BufReader, BufWriter, Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};

use crate::queue::{JobsError, NewJob, Result};

/// Requests held in memory before spilling to a file.
pub const IN_MEMORY: usize = 1 << 20;

/// A submission's requests, in order.
pub struct Spool {
    dir: PathBuf,
    memory: Vec<Vec<u8>>,
    bytes: usize,
    file: Option<BufWriter<File>>,
    count: usize,
}

fn io(e: std::io::Error) -> JobsError {
    JobsError::Store(format!("cannot spool the submission: {e}"))
}

impl Spool {
    /// An empty spool spilling into `dir`.
    pub fn new(dir: &Path) -> Spool {
        Spool {
            dir: dir.to_path_buf(),
            memory: Vec::new(),
            bytes: 0,
            file: None,
            count: 0,
        }
    }

    /// Requests so far.
    pub fn len(&self) -> usize {
        self.count
    }

    /// Whether it holds none.
    pub fn is_empty(&self) -> bool {
        self.count == 0
    }

    /// Adds a request.
    pub fn push(&mut self, request: &[u8]) -> Result<()> {
        self.count += 1;
        if self.file.is_none() && self.bytes + request.len() <= IN_MEMORY {
            self.bytes += request.len();
            self.memory.push(request.to_vec());
            return Ok(());
        }
        if self.file.is_none() {
            let mut file = BufWriter::with_capacity(256 << 10, self.create()?);
            for held in std::mem::take(&mut self.memory) {
                write_one(&mut file, &held)?;
            }
            self.file = Some(file);
        }
        match &mut self.file {
            Some(file) => write_one(file, request),
            None => Ok(()),
        }
    }

    /// A fresh file in the folder, unlinked at once (it goes with its descriptor).
    fn create(&self) -> Result<File> {
        std::fs::create_dir_all(&self.dir).map_err(io)?;
        let stamp = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos());
        let path = self
            .dir
            .join(format!(".spool-{}-{stamp}", std::process::id()));
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .open(&path)
            .map_err(io)?;
        let _ = std::fs::remove_file(&path);
        Ok(file)
    }

    /// The jobs, for `model` at `priority`, in order.
    pub fn into_jobs(
        self,
        model: String,
        priority: u8,
    ) -> Result<Box<dyn Iterator<Item = Result<NewJob>> + Send>> {
        let make = move |request: Vec<u8>| NewJob {
            model: model.clone(),
            priority,
            request,
        };
        match self.file {
            None => Ok(Box::new(self.memory.into_iter().map(move |r| Ok(make(r))))),
            Some(writer) => {
                let mut file = writer.into_inner().map_err(|e| io(e.into_error()))?;
                file.seek(SeekFrom::Start(0)).map_err(io)?;
                let mut reader = BufReader::with_capacity(256 << 10, file);
                let mut left = self.count;
                Ok(Box::new(std::iter::from_fn(move || {
                    if left == 0 {
                        return None;
                    }
                    left -= 1;
                    Some(read_one(&mut reader).map(&make))
                })))
            }
        }
    }
}

fn write_one(file: &mut BufWriter<File>, request: &[u8]) -> Result<()> {
    file.write_all(&(request.len() as u64).to_le_bytes())
        .map_err(io)?;
    file.write_all(request).map_err(io)
}

fn read_one(reader: &mut BufReader<File>) -> Result<Vec<u8>> {
    let mut len = [0u8; 8];
    reader.read_exact(&mut len).map_err(io)?;
    let mut request = vec![0u8; u64::from_le_bytes(len) as usize];
    reader.read_exact(&mut request).map_err(io)?;
    Ok(request)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spills_to_a_file_and_reads_back_in_order() {
        let dir = std::env::temp_dir().join(format!("kiln-spool-{}", std::process::id()));
        let mut spool = Spool::new(&dir);
        let big = vec![b'x'; 300 << 10];
        for i in 0..10u8 {
            let mut r = big.clone();
            r[0] = i;
            spool.push(&r).unwrap();
        }
        assert!(spool.file.is_some());
        let jobs: Vec<NewJob> = spool
            .into_jobs("m".into(), 3)
            .unwrap()
            .map(|j| j.unwrap())
            .collect();
        assert_eq!(jobs.len(), 10);
        assert!(jobs
            .iter()
            .enumerate()
            .all(|(i, j)| j.request[0] == i as u8 && j.request.len() == big.len()));
        assert_eq!(jobs[0].priority, 3);
        // The unlinked file left nothing behind.
        assert_eq!(std::fs::read_dir(&dir).unwrap().count(), 0);
    }
}
