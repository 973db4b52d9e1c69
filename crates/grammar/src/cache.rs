// SPDX-License-Identifier: MIT OR Apache-2.0
//! A small least-recently-used map for compiled grammars.

use std::collections::HashMap;
use std::hash::Hash;

/// At most `capacity` entries; inserting into a full map drops the least recently used one.
/// Eviction scans every entry, which is cheap at the few hundred entries this holds.
pub(crate) struct Lru<K, V> {
    /// Each value with the clock reading of its last use; readings are unique.
    entries: HashMap<K, (V, u64)>,
    capacity: usize,
    clock: u64,
}

impl<K: Hash + Eq, V: Clone> Lru<K, V> {
    pub(crate) fn new(capacity: usize) -> Self {
        assert!(capacity > 0, "an LRU cache needs room for one entry");
        Lru {
            entries: HashMap::new(),
            capacity,
            clock: 0,
        }
    }

    /// The value for `key`, inserting `make()` first if it is absent; either way `key` becomes
    /// the most recently used.
    pub(crate) fn get_or_insert_with(&mut self, key: K, make: impl FnOnce() -> V) -> V {
        self.clock += 1;
        let now = self.clock;
        if let Some((value, used)) = self.entries.get_mut(&key) {
            *used = now;
            return value.clone();
        }
        if self.entries.len() >= self.capacity {
            let oldest = self.entries.values().map(|(_, used)| *used).min();
            self.entries.retain(|_, (_, used)| Some(*used) != oldest);
        }
        let value = make();
        self.entries.insert(key, (value.clone(), now));
        value
    }
}

#[cfg(test)]
mod tests {
    use super::Lru;

    #[test]
    fn evicts_the_least_recently_used() {
        let mut lru = Lru::new(2);
        assert_eq!(lru.get_or_insert_with("a", || 1), 1);
        assert_eq!(lru.get_or_insert_with("b", || 2), 2);
        assert_eq!(lru.get_or_insert_with("a", || 10), 1); // a is now newer than b
        assert_eq!(lru.get_or_insert_with("c", || 3), 3); // evicts b
        assert_eq!(lru.get_or_insert_with("a", || 10), 1);
        assert_eq!(lru.get_or_insert_with("b", || 20), 20);
        assert_eq!(lru.entries.len(), 2);
    }
}
