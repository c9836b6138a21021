//! How a batch is cut into chunks that go through the GPU one staging set each:
//! byte ranges of every input and of the output. Pure host logic (tested without a
//! GPU).

use std::ops::Range;

/// Most inputs a kernel takes (matvec: matrix and vector).
pub const MAX_INPUTS: usize = 2;

/// One chunk: the byte range of each input (those past the kernel's inputs are
/// empty; a fixed array, so planning a chunk allocates nothing) and of the output
/// it covers, and the number of items (bytes or rows) the kernel processes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Chunk {
    pub inputs: [Range<usize>; MAX_INPUTS],
    pub output: Range<usize>,
    pub items: usize,
}

/// Elementwise over bytes (image inversion): `total` bytes in chunks of
/// `chunk_bytes` (a multiple of 4 so every chunk but the last is whole words).
pub fn bytes(total: usize, chunk_bytes: usize) -> impl Iterator<Item = Chunk> {
    let step = chunk_bytes.max(4);
    (0..total).step_by(step).map(move |start| {
        let end = (start + step).min(total);
        Chunk {
            inputs: [start..end, 0..0],
            output: start..end,
            items: end - start,
        }
    })
}

/// Row-wise (batched matrix–vector): `requests` requests of `input_row_bytes`
/// per input and `output_row_bytes` of output each, `chunk_rows` requests a chunk.
pub fn rows(
    requests: usize,
    chunk_rows: usize,
    input_row_bytes: [usize; MAX_INPUTS],
    output_row_bytes: usize,
) -> impl Iterator<Item = Chunk> {
    let step = chunk_rows.max(1);
    (0..requests).step_by(step).map(move |start| {
        let end = (start + step).min(requests);
        Chunk {
            inputs: input_row_bytes.map(|b| start * b..end * b),
            output: start * output_row_bytes..end * output_row_bytes,
            items: end - start,
        }
    })
}

/// Grid size for `threads` threads in blocks of `block` (at least one block, at
/// most the grid-stride loop's cap: extra threads would only loop zero times).
pub fn grid(threads: usize, block: u32, cap: u32) -> u32 {
    let blocks = threads.div_ceil(block.max(1) as usize).max(1);
    u32::try_from(blocks).unwrap_or(u32::MAX).min(cap)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn byte_chunks_cover_everything_once() {
        let chunks: Vec<_> = bytes(10_000, 4096).collect();
        assert_eq!(chunks.len(), 3);
        assert_eq!(chunks[0].inputs, [0..4096, 0..0]);
        assert_eq!(chunks[2].output, 8192..10_000);
        assert_eq!(chunks.iter().map(|c| c.items).sum::<usize>(), 10_000);
        assert_eq!(bytes(0, 4096).count(), 0);
        assert_eq!(bytes(3, 4096).collect::<Vec<_>>()[0].items, 3);
    }

    #[test]
    fn row_chunks_split_every_input_at_the_same_requests() {
        let per_row = [12usize, 4];
        let chunks: Vec<_> = rows(5, 2, per_row, 8).collect();
        assert_eq!(chunks.len(), 3);
        assert_eq!(chunks[1].inputs, [24..48, 8..16]);
        assert_eq!(chunks[1].output, 16..32);
        assert_eq!(chunks[2].items, 1);
        assert_eq!(chunks[2].inputs, [48..60, 16..20]);
    }

    #[test]
    fn grid_is_bounded() {
        assert_eq!(grid(0, 256, 1024), 1);
        assert_eq!(grid(257, 256, 1024), 2);
        assert_eq!(grid(usize::MAX, 256, 1024), 1024);
    }
}
