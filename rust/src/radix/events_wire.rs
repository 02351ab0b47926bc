//! vLLM's KV event wire form, written as msgpack straight from the Rust events (with the `rmp`
//! crate), so that publishing makes no Python object per token or hash.
//!
//! Source of the layout: vLLM's event classes, field names and order as at
//! <https://github.com/vllm-project/vllm/blob/0181ea3173e53eea8cf04a86891488e3dc89bb34/vllm/distributed/kv_events.py>, the positional layout as at
//! <https://github.com/vllm-project/vllm/blob/b4e69e0af33f4698e157a262cc787fe61983cd3d/vllm/distributed/kv_events.py> (before vLLM's PR #42892 made the events maps). Each event is msgspec's tagged encoding of vLLM's event struct:
//!
//! - [`WireFormat::Array`] (`array_like=True`, vLLM <= v0.23): `["BlockStored", block_hashes,
//!   parent_block_hash, token_ids, block_size, lora_id, medium, lora_name(, extra_keys)]`,
//!   `["BlockRemoved", block_hashes, medium]`, `["AllBlocksCleared"]`;
//! - [`WireFormat::Map`] (vLLM since PR #42892): the same fields as a map, the tag under
//!   `"type"` first, in declaration order.
//!
//! `lora_id` and `lora_name` are nil; `extra_keys` (a trailing default field, omitted when nil as
//! msgspec's `omit_defaults` does) is written for a namespace's first page: one entry per block,
//! `[namespace_bytes]` (bin) for the first, nil for the others. Integers take msgpack's smallest
//! unsigned form (as msgspec writes them).

use rmp::encode as mp;

use super::{KvEvent, Medium};

/// How each event is encoded (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WireFormat {
    /// Tagged positional arrays (vLLM <= v0.23; decoded by every router version).
    Array,
    /// Tagged maps (`"type"` key), vLLM since its PR #42892.
    Map,
}

// Writes into a Vec<u8> cannot fail: the results carry no information.
fn uint(out: &mut Vec<u8>, v: u64) {
    let _ = mp::write_uint(out, v);
}
fn text(out: &mut Vec<u8>, s: &str) {
    let _ = mp::write_str(out, s);
}
fn nil(out: &mut Vec<u8>) {
    let _ = mp::write_nil(out);
}
fn array(out: &mut Vec<u8>, n: usize) {
    let _ = mp::write_array_len(out, n as u32);
}
fn map(out: &mut Vec<u8>, n: usize) {
    let _ = mp::write_map_len(out, n as u32);
}
fn uints(out: &mut Vec<u8>, vs: impl ExactSizeIterator<Item = u64>) {
    array(out, vs.len());
    for v in vs {
        uint(out, v);
    }
}

/// Writes one struct header: the tag, then `n` fields follow (each under its name for a map).
struct Fields<'a> {
    out: &'a mut Vec<u8>,
    map: bool,
}

impl<'a> Fields<'a> {
    fn new(out: &'a mut Vec<u8>, fmt: WireFormat, tag: &str, n: usize) -> Self {
        let map = fmt == WireFormat::Map;
        if map {
            self::map(out, n + 1);
            text(out, "type");
        } else {
            array(out, n + 1);
        }
        text(out, tag);
        Self { out, map }
    }
    /// The buffer to write field `name`'s value into.
    fn field(&mut self, name: &str) -> &mut Vec<u8> {
        if self.map {
            text(self.out, name);
        }
        self.out
    }
}

fn medium(out: &mut Vec<u8>, m: Medium) {
    text(out, m.as_str());
}

/// Appends `events` as one msgpack array (the second item of a batch `[ts, events, rank]`).
pub fn encode_events(events: &[KvEvent], fmt: WireFormat, out: &mut Vec<u8>) {
    array(out, events.len());
    for e in events {
        match e {
            KvEvent::BlockStored {
                block_hashes,
                parent_block_hash,
                token_ids,
                block_size,
                medium: m,
                namespace,
            } => {
                let n = 7 + usize::from(namespace.is_some());
                let mut f = Fields::new(out, fmt, "BlockStored", n);
                uints(f.field("block_hashes"), block_hashes.iter().copied());
                match parent_block_hash {
                    Some(p) => uint(f.field("parent_block_hash"), *p),
                    None => nil(f.field("parent_block_hash")),
                }
                // (token ids are non-negative: checked on the way in)
                uints(
                    f.field("token_ids"),
                    token_ids.iter().map(|&t| t as u32 as u64),
                );
                uint(f.field("block_size"), *block_size as u64);
                nil(f.field("lora_id"));
                medium(f.field("medium"), *m);
                nil(f.field("lora_name"));
                if let Some(ns) = namespace {
                    let o = f.field("extra_keys");
                    array(o, block_hashes.len());
                    array(o, 1);
                    let _ = mp::write_bin(o, ns);
                    for _ in 1..block_hashes.len() {
                        nil(o);
                    }
                }
            }
            KvEvent::BlockRemoved {
                block_hashes,
                medium: m,
            } => {
                let mut f = Fields::new(out, fmt, "BlockRemoved", 2);
                uints(f.field("block_hashes"), block_hashes.iter().copied());
                medium(f.field("medium"), *m);
            }
            KvEvent::AllBlocksCleared => {
                Fields::new(out, fmt, "AllBlocksCleared", 0);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bytes_by_hand() {
        let e = [
            KvEvent::BlockStored {
                block_hashes: vec![1 << 40],
                parent_block_hash: Some(5),
                token_ids: vec![1, 200],
                block_size: 2,
                medium: Medium::Gpu,
                namespace: Some(b"ns".to_vec().into_boxed_slice()),
            },
            KvEvent::AllBlocksCleared,
        ];
        let mut out = Vec::new();
        encode_events(&e, WireFormat::Array, &mut out);
        let mut want = vec![0x92, 0x99, 0xab];
        want.extend_from_slice(b"BlockStored");
        want.extend_from_slice(&[
            0x91, 0xcf, 0, 0, 1, 0, 0, 0, 0, 0, 0x05, 0x92, 0x01, 0xcc, 200,
        ]);
        want.extend_from_slice(&[0x02, 0xc0, 0xa3, b'G', b'P', b'U', 0xc0]);
        want.extend_from_slice(&[0x91, 0x91, 0xc4, 2, b'n', b's', 0x91, 0xb0]);
        want.extend_from_slice(b"AllBlocksCleared");
        assert_eq!(out, want);
        let mut m = Vec::new();
        encode_events(&e[1..], WireFormat::Map, &mut m);
        let mut want = vec![0x91, 0x81, 0xa4];
        want.extend_from_slice(b"type");
        want.push(0xb0);
        want.extend_from_slice(b"AllBlocksCleared");
        assert_eq!(m, want);
    }
}
