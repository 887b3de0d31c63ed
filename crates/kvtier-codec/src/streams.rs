//! The lossless stage shared by `lossless` and `quant`: a few byte streams, each compressed by
//! one backend (zstd, lz4 or deflate) or stored when compression would not pay for its decode
//! time (it saves under 1/64 of the stream). Near-random streams (the low bytes of fp16 values)
//! are therefore copied, not entropy-decoded, which is what keeps decode fast.
//!
//! Stream table (docs/formats.md §5.1): u8 backend, i8 level, u8 stream count, u8 zero; then
//! per stream u8 mode (0 stored, 1 compressed), three zero bytes, u32 raw length, u32 stored
//! length. The body is the streams' stored bytes, back to back.

use std::cell::RefCell;

use crate::error::CodecError;
use crate::header::Reader;

/// A lossless backend; the code is what the stream table records.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum Backend {
    /// No compression: every stream is stored.
    None = 0,
    Zstd = 1,
    Lz4 = 2,
    Deflate = 3,
}

impl Backend {
    pub const ALL: [Backend; 4] = [Backend::None, Backend::Zstd, Backend::Lz4, Backend::Deflate];

    pub fn from_code(code: u8) -> Result<Self, CodecError> {
        Self::ALL.get(code as usize).copied().ok_or(CodecError::UnknownBackend { code })
    }

    pub fn name(self) -> &'static str {
        match self {
            Backend::None => "none",
            Backend::Zstd => "zstd",
            Backend::Lz4 => "lz4",
            Backend::Deflate => "deflate",
        }
    }

    /// The backend called `name`, or `None` for an unknown name.
    pub fn from_name(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|b| b.name() == name)
    }

    /// Default level: zstd 3, deflate 6 (libdeflate levels 1..=12); lz4 and none ignore it.
    pub fn default_level(self) -> i8 {
        match self {
            Backend::Zstd => 3,
            Backend::Deflate => 6,
            Backend::None | Backend::Lz4 => 0,
        }
    }

    /// Checks `level` for this backend.
    pub fn check_level(self, level: i8) -> Result<(), CodecError> {
        let ok = match self {
            Backend::Zstd => (-7..=22).contains(&level),
            Backend::Deflate => (1..=12).contains(&level),
            Backend::None | Backend::Lz4 => level == 0,
        };
        if ok {
            Ok(())
        } else {
            Err(CodecError::InvalidParam { what: "backend level", value: level as u8 as u64 })
        }
    }
}

/// Backend plus level: the lossless stage of a codec.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Stage {
    pub backend: Backend,
    pub level: i8,
}

impl Stage {
    pub fn new(backend: Backend, level: i8) -> Result<Self, CodecError> {
        backend.check_level(level)?;
        Ok(Self { backend, level })
    }
}

pub fn table_len(count: usize) -> usize {
    4 + 12 * count
}

/// Largest body `encode_streams` can write: a stream that does not shrink is stored, so the body
/// never exceeds the raw streams.
pub fn max_body_len(raw_lens: &[usize]) -> usize {
    raw_lens.iter().sum()
}

/// Compresses `streams` into `body` and writes the table into `table`; returns the body length.
pub fn encode_streams(
    stage: Stage,
    streams: &[&[u8]],
    table: &mut [u8],
    body: &mut [u8],
) -> Result<usize, CodecError> {
    debug_assert_eq!(table.len(), table_len(streams.len()));
    table[0] = stage.backend as u8;
    table[1] = stage.level as u8;
    table[2] = u8::try_from(streams.len()).expect("few streams");
    table[3] = 0;
    let mut pos = 0;
    for (i, src) in streams.iter().enumerate() {
        let room = &mut body[pos..];
        let compressed = compress(stage, src, room)?;
        let keep = compressed.filter(|&n| n < src.len() - src.len() / 64);
        let (mode, stored_len) = match keep {
            Some(n) => (1u8, n),
            None => {
                room[..src.len()].copy_from_slice(src);
                (0u8, src.len())
            }
        };
        let entry = &mut table[4 + 12 * i..4 + 12 * (i + 1)];
        entry[0] = mode;
        entry[1..4].fill(0);
        entry[4..8].copy_from_slice(&u32::try_from(src.len()).map_err(|_| too_big(src.len()))?.to_le_bytes());
        entry[8..12].copy_from_slice(&(stored_len as u32).to_le_bytes());
        pos += stored_len;
    }
    Ok(pos)
}

fn too_big(len: usize) -> CodecError {
    CodecError::InvalidParam { what: "stream length (over 4 GiB)", value: len as u64 }
}

/// One parsed stream of a table, with its stored bytes.
#[derive(Debug, Clone, Copy)]
pub struct Stream<'a> {
    pub compressed: bool,
    pub stored: &'a [u8],
    pub raw_len: usize,
}

/// A stream slot before [`parse_streams`] fills it.
pub const NO_STREAM: Stream<'static> = Stream { compressed: false, stored: &[], raw_len: 0 };

/// Parses a table of exactly `raw_lens.len()` streams whose raw lengths must equal `raw_lens`,
/// and splits `body` among them (their stored lengths must add up to the body exactly) into
/// `parts[..raw_lens.len()]`, without allocating. Returns the table's backend.
pub fn parse_streams<'a>(
    r: &mut Reader<'_>,
    raw_lens: &[usize],
    body: &'a [u8],
    parts: &mut [Stream<'a>],
) -> Result<Backend, CodecError> {
    assert!(parts.len() >= raw_lens.len(), "one slot per stream");
    let backend = Backend::from_code(r.u8()?)?;
    let level = r.u8()? as i8;
    backend.check_level(level)?;
    let count = r.u8()? as usize;
    if count != raw_lens.len() {
        return Err(CodecError::InvalidParam { what: "stream count", value: count as u64 });
    }
    if r.u8()? != 0 {
        return Err(CodecError::InvalidParam { what: "stream table reserved byte", value: 1 });
    }
    let mut pos = 0usize;
    for (&expected, part) in raw_lens.iter().zip(parts.iter_mut()) {
        let mode = r.u8()?;
        if mode > 1 || (mode == 1 && backend == Backend::None) {
            return Err(CodecError::InvalidParam { what: "stream mode", value: mode as u64 });
        }
        if r.bytes(3)? != [0, 0, 0] {
            return Err(CodecError::InvalidParam { what: "stream reserved bytes", value: 1 });
        }
        let raw_len = r.u32()? as usize;
        let stored_len = r.u32()? as usize;
        if raw_len != expected {
            return Err(CodecError::LengthMismatch {
                what: "stream raw length",
                declared: raw_len as u64,
                actual: expected as u64,
            });
        }
        if mode == 0 && stored_len != raw_len {
            return Err(CodecError::LengthMismatch {
                what: "stored stream",
                declared: stored_len as u64,
                actual: raw_len as u64,
            });
        }
        let end = pos.checked_add(stored_len).filter(|&e| e <= body.len()).ok_or(CodecError::Truncated {
            what: "stream body",
            needed: pos as u64 + stored_len as u64,
            have: body.len() as u64,
        })?;
        *part = Stream { compressed: mode == 1, stored: &body[pos..end], raw_len };
        pos = end;
    }
    if pos != body.len() {
        return Err(CodecError::LengthMismatch {
            what: "body",
            declared: body.len() as u64,
            actual: pos as u64,
        });
    }
    Ok(backend)
}

/// Decodes one stream into `dst` (exactly its raw length).
pub fn decode_stream(backend: Backend, stream: &Stream<'_>, dst: &mut [u8]) -> Result<(), CodecError> {
    debug_assert_eq!(dst.len(), stream.raw_len);
    if !stream.compressed {
        dst.copy_from_slice(stream.stored);
        return Ok(());
    }
    let corrupt = CodecError::Corrupt { backend: backend.name() };
    let n = match backend {
        Backend::None => return Err(corrupt),
        Backend::Zstd => ZSTD_DECODER.with(|d| {
            let mut d = d.borrow_mut();
            let d = d.as_mut().ok_or(corrupt.clone())?;
            d.decompress_to_buffer(stream.stored, dst).map_err(|_| corrupt.clone())
        })?,
        Backend::Lz4 => lz4_flex::block::decompress_into(stream.stored, dst).map_err(|_| corrupt.clone())?,
        Backend::Deflate => DEFLATE_DECODER
            .with(|d| d.borrow_mut().deflate_decompress(stream.stored, dst))
            .map_err(|_| corrupt.clone())?,
    };
    if n != dst.len() {
        return Err(corrupt);
    }
    Ok(())
}

thread_local! {
    static LZ4_SCRATCH: RefCell<Vec<u8>> = const { RefCell::new(Vec::new()) };
    static ZSTD_DECODER: RefCell<Option<zstd::bulk::Decompressor<'static>>> =
        RefCell::new(zstd::bulk::Decompressor::new().ok());
    static DEFLATE_DECODER: RefCell<libdeflater::Decompressor> = RefCell::new(libdeflater::Decompressor::new());
}

/// Compressed length, or `None` when the output did not fit (the stream is then stored).
fn compress(stage: Stage, src: &[u8], dst: &mut [u8]) -> Result<Option<usize>, CodecError> {
    let room = dst.len().min(src.len());
    let dst = &mut dst[..room];
    Ok(match stage.backend {
        Backend::None => None,
        Backend::Zstd => zstd::bulk::compress_to_buffer(src, dst, stage.level as i32).ok(),
        // lz4_flex refuses an output shorter than its worst-case bound (a little over the input),
        // so compress into a scratch buffer of that size and keep the result only if it fits.
        Backend::Lz4 => LZ4_SCRATCH.with(|scratch| {
            let mut scratch = scratch.borrow_mut();
            scratch.resize(lz4_flex::block::get_maximum_output_size(src.len()), 0);
            let n = lz4_flex::block::compress_into(src, &mut scratch).ok()?;
            (n <= dst.len()).then(|| {
                dst[..n].copy_from_slice(&scratch[..n]);
                n
            })
        }),
        Backend::Deflate => {
            let level = libdeflater::CompressionLvl::new(stage.level as i32)
                .map_err(|_| CodecError::CompressFailed { backend: "deflate" })?;
            libdeflater::Compressor::new(level).deflate_compress(src, dst).ok()
        }
    })
}
/// Splits 16-bit little-endian values into low and high byte planes.
pub fn shuffle2(input: &[u8], lo: &mut [u8], hi: &mut [u8]) {
    for ((pair, l), h) in input.chunks_exact(2).zip(lo.iter_mut()).zip(hi.iter_mut()) {
        *l = pair[0];
        *h = pair[1];
    }
}

/// Interleaves low and high byte planes back into 16-bit little-endian values.
pub fn unshuffle2(lo: &[u8], hi: &[u8], out: &mut [u8]) {
    for ((pair, &l), &h) in out.chunks_exact_mut(2).zip(lo).zip(hi) {
        pair[0] = l;
        pair[1] = h;
    }
}
