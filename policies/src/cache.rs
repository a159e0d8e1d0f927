//! Whether a request may read and write the cache, from the configuration and the request's
//! `Cache-Control` directives.

/// The request's cache directives.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Directives {
    /// `no-cache`: do not answer from the cache; do store the fresh answer.
    pub no_cache: bool,
    /// `no-store`: neither read nor write.
    pub no_store: bool,
    /// `only-if-cached`: answer from the cache or not at all; never store.
    pub only_if_cached: bool,
}

/// What the request may do with the cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Access {
    /// Look the request up.
    pub read: bool,
    /// Store its answer.
    pub write: bool,
    /// Send it to the backend on a miss.
    pub forward: bool,
}

/// Decides the cache access of one request.
pub fn access(enabled: bool, d: Directives) -> Access {
    Access {
        read: enabled && !d.no_cache && !d.no_store,
        write: enabled && !d.no_store && !d.only_if_cached,
        forward: !d.only_if_cached,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn directives() {
        let all = access(true, Directives::default());
        assert!(all.read && all.write && all.forward);
        let nc = access(
            true,
            Directives {
                no_cache: true,
                ..Default::default()
            },
        );
        assert!(!nc.read && nc.write);
        let ns = access(
            true,
            Directives {
                no_store: true,
                ..Default::default()
            },
        );
        assert!(!ns.read && !ns.write && ns.forward);
        let oic = access(
            true,
            Directives {
                only_if_cached: true,
                ..Default::default()
            },
        );
        assert!(oic.read && !oic.write && !oic.forward);
        let off = access(false, Directives::default());
        assert!(!off.read && !off.write && off.forward);
    }
}
