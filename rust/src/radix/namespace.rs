//! Cache namespaces: the caller's key (adapter id, salt, ...) as canonical tagged bytes.

/// A cache namespace: a canonical, tagged byte encoding of the caller's key (adapter id, salt, ...).
///
/// Each value is written as a tag byte, a length and its bytes, so the encoding is injective:
/// `("lora", 1)` and `("salt", "1")` (or `1` and `"1"`) can never produce the same key, and no
/// hashing is involved (no collisions). The default namespace is [`Namespace::none`].
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Namespace(Vec<u8>);

impl Default for Namespace {
    fn default() -> Self {
        Self::none()
    }
}

impl Namespace {
    /// The namespace of requests without adapter or salt (Python `namespace=None`).
    pub fn none() -> Self {
        let mut b = NamespaceBuilder::new();
        b.none();
        b.finish()
    }
    pub fn builder() -> NamespaceBuilder {
        NamespaceBuilder::new()
    }
    pub fn as_bytes(&self) -> &[u8] {
        &self.0
    }
    /// The namespace whose canonical bytes are `b` (bytes from [`as_bytes`](Self::as_bytes)).
    pub(crate) fn from_bytes(b: &[u8]) -> Self {
        Self(b.to_vec())
    }
}

/// Writes a namespace value by value; a tuple announces its length, then its items follow.
#[derive(Debug, Default)]
pub struct NamespaceBuilder(Vec<u8>);

impl NamespaceBuilder {
    pub fn new() -> Self {
        Self(Vec::with_capacity(32))
    }
    fn item(&mut self, tag: u8, payload: &[u8]) -> &mut Self {
        self.0.push(tag);
        self.0
            .extend_from_slice(&(payload.len() as u64).to_le_bytes());
        self.0.extend_from_slice(payload);
        self
    }
    pub fn none(&mut self) -> &mut Self {
        self.item(b'N', &[])
    }
    pub fn int(&mut self, v: i64) -> &mut Self {
        self.int_le(&v.to_le_bytes())
    }
    /// An integer of any width as two's-complement little-endian bytes; written canonically (no
    /// redundant sign bytes), so one value always gives one key whatever width it came in.
    pub fn int_le(&mut self, le: &[u8]) -> &mut Self {
        let mut n = le.len();
        while n > 1 {
            let (last, prev) = (le[n - 1], le[n - 2]);
            if (last == 0 && prev & 0x80 == 0) || (last == 0xFF && prev & 0x80 != 0) {
                n -= 1;
            } else {
                break;
            }
        }
        let canon: &[u8] = if le.is_empty() { &[0] } else { &le[..n] };
        self.item(b'I', canon)
    }
    pub fn str(&mut self, s: &str) -> &mut Self {
        self.item(b'S', s.as_bytes())
    }
    pub fn bytes(&mut self, b: &[u8]) -> &mut Self {
        self.item(b'B', b)
    }
    /// Starts a tuple of `len` items (written next).
    pub fn tuple(&mut self, len: usize) -> &mut Self {
        self.item(b'T', &(len as u64).to_le_bytes())
    }
    pub fn finish(self) -> Namespace {
        Namespace(self.0)
    }
}
