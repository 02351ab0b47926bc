//! The children of a radix node: found by the first token of their key, an only child kept
//! inline, two or more in a hash map (see [`Children`]).

use std::collections::HashMap;

/// Children of a node, found by the first token of their key; the first page decides equality
/// (with page_size > 1, two children may share a first token). An only child is kept inline (a
/// chain of turns, a path below a split: no hashing, no table); from two children on, hashing one
/// token keeps lookups cheap for any page size, with std's DoS-resistant hasher.
#[derive(Debug, Default)]
pub(super) struct Children {
    /// The child while there is exactly one (then `map` is empty).
    solo: Option<(i32, u32)>,
    /// All children while there are two or more.
    map: HashMap<i32, Kids>,
    len: usize,
}

#[derive(Debug)]
enum Kids {
    One(u32),
    Many(Vec<u32>),
}

impl Children {
    pub(super) fn len(&self) -> usize {
        self.len
    }
    pub(super) fn is_empty(&self) -> bool {
        self.len == 0
    }
    pub(super) fn candidates(&self, first: i32) -> &[u32] {
        if let Some((f, id)) = &self.solo {
            return if *f == first {
                std::slice::from_ref(id)
            } else {
                &[]
            };
        }
        if self.len == 0 {
            return &[];
        }
        match self.map.get(&first) {
            Some(Kids::One(id)) => std::slice::from_ref(id),
            Some(Kids::Many(v)) => v,
            None => &[],
        }
    }
    pub(super) fn entries(&self) -> impl Iterator<Item = (i32, u32)> + '_ {
        self.solo
            .into_iter()
            .chain(self.map.iter().flat_map(|(&f, k)| {
                let ids: &[u32] = match k {
                    Kids::One(id) => std::slice::from_ref(id),
                    Kids::Many(v) => v,
                };
                ids.iter().map(move |&id| (f, id))
            }))
    }
    pub(super) fn ids(&self) -> impl Iterator<Item = u32> + '_ {
        self.entries().map(|(_, id)| id)
    }
    /// Whether the representation is the one its count calls for.
    pub(super) fn well_formed(&self) -> bool {
        match self.len {
            0 => self.solo.is_none() && self.map.is_empty(),
            1 => self.solo.is_some() && self.map.is_empty(),
            _ => self.solo.is_none(),
        }
    }
    pub(super) fn insert(&mut self, first: i32, id: u32) {
        if self.len == 0 {
            self.solo = Some((first, id));
            self.len = 1;
            return;
        }
        if let Some((f, only)) = self.solo.take() {
            self.map_insert(f, only);
        }
        self.map_insert(first, id);
        self.len += 1;
    }
    pub(super) fn map_insert(&mut self, first: i32, id: u32) {
        match self.map.get_mut(&first) {
            None => {
                self.map.insert(first, Kids::One(id));
            }
            Some(Kids::Many(v)) => v.push(id),
            Some(k @ Kids::One(_)) => {
                if let Kids::One(old) = *k {
                    *k = Kids::Many(vec![old, id]);
                }
            }
        }
    }
    pub(super) fn remove(&mut self, first: i32, id: u32) {
        if self.solo.is_some() {
            if self.solo == Some((first, id)) {
                self.solo = None;
                self.len = 0;
            }
            return;
        }
        let Some(k) = self.map.get_mut(&first) else {
            return;
        };
        match k {
            Kids::One(x) if *x == id => {
                self.map.remove(&first);
                self.len -= 1;
            }
            Kids::Many(v) => {
                if let Some(i) = v.iter().position(|&x| x == id) {
                    v.swap_remove(i);
                    self.len -= 1;
                    if let [only] = v[..] {
                        *k = Kids::One(only);
                    }
                }
            }
            Kids::One(_) => {}
        }
        if self.len == 1 {
            // Back to one child: inline again (the table keeps its memory for a next sibling).
            let only = self.entries().next();
            self.map.clear();
            self.solo = only;
        }
    }
    pub(super) fn replace(&mut self, first: i32, old: u32, new: u32) {
        if let Some((f, id)) = &mut self.solo {
            if *f == first && *id == old {
                *id = new;
            }
            return;
        }
        match self.map.get_mut(&first) {
            Some(Kids::One(x)) if *x == old => *x = new,
            Some(Kids::Many(v)) => v.iter_mut().filter(|x| **x == old).for_each(|x| *x = new),
            _ => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn children_inline_one_then_table() {
        let mut c = Children::default();
        assert!(c.candidates(5).is_empty() && c.well_formed());
        c.insert(5, 10);
        assert!(c.solo == Some((5, 10)) && c.well_formed());
        assert_eq!((c.candidates(5), c.candidates(6)), (&[10][..], &[][..]));
        c.replace(5, 10, 11);
        assert_eq!(c.candidates(5), &[11]);
        c.insert(5, 12); // same first token (page_size > 1)
        c.insert(7, 13);
        assert!(c.solo.is_none() && c.well_formed() && c.len() == 3);
        assert_eq!(c.candidates(5), &[11, 12]);
        c.remove(5, 11);
        c.remove(5, 99); // not a child: nothing
        assert_eq!(c.len(), 2);
        c.remove(7, 13);
        assert!(c.solo == Some((5, 12)) && c.well_formed());
        assert_eq!(c.ids().collect::<Vec<_>>(), vec![12]);
        c.remove(7, 12); // wrong first token: nothing
        c.remove(5, 12);
        assert!(c.is_empty() && c.well_formed() && c.candidates(5).is_empty());
    }
}
