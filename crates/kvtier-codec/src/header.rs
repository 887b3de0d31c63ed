//! The common 24-byte codec payload header (docs/formats.md §5) and a bounds-checked reader.
//!
//! Layout: magic `KVCP`, version u16 = 1, codec id u16, decoded length u64, params length u32,
//! body length u32. The payload is exactly `24 + params_len + body_len` bytes: a reader never
//! guesses a size, and any disagreement is a typed error.

use crate::error::CodecError;

pub const MAGIC: [u8; 4] = *b"KVCP";
pub const VERSION: u16 = 1;
pub const HEADER_LEN: usize = 24;
/// Largest decoded length a header may declare: one object is one KV block (a few MiB for the
/// largest models), so anything beyond this is a corrupt or hostile header, refused before a
/// reader allocates for it.
pub const DECODED_LEN_MAX: u64 = 1 << 30;

/// Parsed common header plus the params and body slices it frames.
#[derive(Debug, Clone, Copy)]
pub struct Framed<'a> {
    pub codec_id: u16,
    pub decoded_len: u64,
    pub params: &'a [u8],
    pub body: &'a [u8],
}

/// Writes the common header into `out[..24]`.
pub fn write_header(out: &mut [u8], codec_id: u16, decoded_len: u64, params_len: u32, body_len: u32) {
    out[0..4].copy_from_slice(&MAGIC);
    out[4..6].copy_from_slice(&VERSION.to_le_bytes());
    out[6..8].copy_from_slice(&codec_id.to_le_bytes());
    out[8..16].copy_from_slice(&decoded_len.to_le_bytes());
    out[16..20].copy_from_slice(&params_len.to_le_bytes());
    out[20..24].copy_from_slice(&body_len.to_le_bytes());
}

/// Checks magic, version, codec id and the exact payload length; splits params from body.
pub fn parse(payload: &[u8], expected_codec: u16) -> Result<Framed<'_>, CodecError> {
    if payload.is_empty() {
        return Err(CodecError::EmptyInput);
    }
    let mut r = Reader::new(payload, "payload header");
    let magic = r.bytes(4)?;
    if magic != MAGIC {
        return Err(CodecError::BadMagic);
    }
    let version = r.u16()?;
    if version != VERSION {
        return Err(CodecError::UnsupportedVersion { version });
    }
    let codec_id = r.u16()?;
    if codec_id != expected_codec {
        return Err(CodecError::CodecMismatch { expected: expected_codec, found: codec_id });
    }
    let decoded_len = r.u64()?;
    if decoded_len == 0 || decoded_len > DECODED_LEN_MAX {
        return Err(CodecError::InvalidParam { what: "decoded length", value: decoded_len });
    }
    let params_len = r.u32()? as u64;
    let body_len = r.u32()? as u64;
    let total = HEADER_LEN as u64 + params_len + body_len;
    if total != payload.len() as u64 {
        return Err(CodecError::LengthMismatch {
            what: "payload",
            declared: total,
            actual: payload.len() as u64,
        });
    }
    let params = r.bytes(params_len as usize)?;
    let body = r.bytes(body_len as usize)?;
    Ok(Framed { codec_id, decoded_len, params, body })
}

/// Little-endian reader over untrusted bytes: every read is bounds-checked.
pub struct Reader<'a> {
    data: &'a [u8],
    pos: usize,
    what: &'static str,
}

impl<'a> Reader<'a> {
    pub fn new(data: &'a [u8], what: &'static str) -> Self {
        Self { data, pos: 0, what }
    }

    pub fn remaining(&self) -> usize {
        self.data.len() - self.pos
    }

    pub fn bytes(&mut self, n: usize) -> Result<&'a [u8], CodecError> {
        if self.remaining() < n {
            return Err(CodecError::Truncated {
                what: self.what,
                needed: (self.pos as u64).saturating_add(n as u64),
                have: self.data.len() as u64,
            });
        }
        let s = &self.data[self.pos..self.pos + n];
        self.pos += n;
        Ok(s)
    }

    pub fn u8(&mut self) -> Result<u8, CodecError> {
        Ok(self.bytes(1)?[0])
    }

    pub fn u16(&mut self) -> Result<u16, CodecError> {
        Ok(u16::from_le_bytes(self.bytes(2)?.try_into().expect("2 bytes")))
    }

    pub fn u32(&mut self) -> Result<u32, CodecError> {
        Ok(u32::from_le_bytes(self.bytes(4)?.try_into().expect("4 bytes")))
    }

    pub fn u64(&mut self) -> Result<u64, CodecError> {
        Ok(u64::from_le_bytes(self.bytes(8)?.try_into().expect("8 bytes")))
    }
}
