//! Key names under the prefix (the data model of the [parent module](super)), with the hash
//! tags that tie a key's cluster slot to the id or name it holds.

use std::fmt::Write as _;

use crate::entry::{Digest, EntryId};

/// Key names under the prefix.
#[derive(Debug, Clone)]
pub(super) struct Keys {
    pub(super) prefix: String,
}

impl Keys {
    pub(super) fn entry(&self, id: EntryId) -> String {
        format!("{}:e:{{{id}}}", self.prefix)
    }

    /// Marks an entry deleted (see `put::FENCE_MS`): in the entry's slot.
    pub(super) fn deleted(&self, id: EntryId) -> String {
        format!("{}:d:{{{id}}}", self.prefix)
    }

    pub(super) fn key(&self, digest: &Digest) -> String {
        let mut s = String::with_capacity(self.prefix.len() + 3 + 64);
        s.push_str(&self.prefix);
        s.push_str(":k:");
        for b in digest {
            // Writing into a String cannot fail.
            let _ = write!(s, "{b:02x}");
        }
        s
    }

    pub(super) fn namespace(&self, ns: &str) -> String {
        format!("{}:ns:{{{ns}}}", self.prefix)
    }

    pub(super) fn tag(&self, tag: &str) -> String {
        format!("{}:tag:{{{tag}}}", self.prefix)
    }

    /// The fences of a tag within namespace prefixes (a tenant's tag delete): a hash of
    /// prefix → when its fence ends, in the tag set's slot.
    pub(super) fn tag_fences(&self, tag: &str) -> String {
        format!("{}:tagfence:{{{tag}}}", self.prefix)
    }

    pub(super) fn events(&self) -> String {
        format!("{}:events", self.prefix)
    }

    pub(super) fn policies(&self) -> String {
        format!("{}:policies", self.prefix)
    }

    pub(super) fn epoch(&self) -> String {
        format!("{}:epoch", self.prefix)
    }

    pub(super) fn blob(&self, name: &str) -> String {
        format!("{}:blob:{{{name}}}", self.prefix)
    }

    pub(super) fn hash(&self, name: &str) -> String {
        format!("{}:hash:{{{name}}}", self.prefix)
    }

    /// Held by the replica sweeping the index sets ([`super::sweep`]) for one interval.
    pub(super) fn sweep_lock(&self) -> String {
        format!("{}:sweep", self.prefix)
    }

    /// SCAN pattern matching every entry key; glob characters of the prefix are escaped.
    pub(super) fn entry_pattern(&self) -> String {
        self.pattern(":e:*")
    }

    /// SCAN patterns matching every namespace and every tag index set.
    pub(super) fn index_patterns(&self) -> [String; 2] {
        [self.pattern(":ns:*"), self.pattern(":tag:*")]
    }

    /// The prefix, its glob characters escaped, then `rest`.
    fn pattern(&self, rest: &str) -> String {
        let mut s = String::with_capacity(self.prefix.len() + rest.len() + 2);
        for c in self.prefix.chars() {
            if matches!(c, '*' | '?' | '[' | ']' | '\\') {
                s.push('\\');
            }
            s.push(c);
        }
        s.push_str(rest);
        s
    }

    /// The id inside an entry key (`{prefix}:e:{<id>}`).
    pub(super) fn id_of_entry_key(&self, key: &str) -> Option<EntryId> {
        let rest = key.strip_prefix(&self.prefix)?.strip_prefix(":e:{")?;
        rest.strip_suffix('}')?.parse().ok()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn key_names() {
        let keys = Keys {
            prefix: "p*x".into(),
        };
        let id = EntryId(0xab);
        let name = keys.entry(id);
        assert_eq!(name, "p*x:e:{000000000000000000000000000000ab}");
        assert_eq!(keys.id_of_entry_key(&name), Some(id));
        assert_eq!(keys.id_of_entry_key("p*x:e:{zz}"), None);
        assert_eq!(keys.key(&[0xff; 32]), format!("p*x:k:{}", "ff".repeat(32)));
        assert_eq!(keys.namespace("acme"), "p*x:ns:{acme}");
        assert_eq!(keys.entry_pattern(), "p\\*x:e:*");
        assert_eq!(keys.index_patterns(), ["p\\*x:ns:*", "p\\*x:tag:*"]);
        assert_eq!(keys.policies(), "p*x:policies");
        assert_eq!(keys.hash("stats:60:0"), "p*x:hash:{stats:60:0}");
    }
}
