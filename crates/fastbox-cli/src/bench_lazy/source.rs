//! The block source of both restore modes: the node's own lazy-resume source
//! ([`StoreBlocks`]: blocks read from the artifact store, verified by the store's read,
//! counted), each block after a fixed delay that stands for the latency of a remote origin or
//! peer. A full zero block is not fetched: it costs no delay and is not counted.

use fastbox_runtime::lazy::restore::Fetched;

pub use fastbox_fastlet::remote_pages::StoreBlocks;

/// `after - before`, field by field.
pub fn since(after: Fetched, before: Fetched) -> Fetched {
    Fetched {
        blocks: after.blocks.saturating_sub(before.blocks),
        bytes: after.bytes.saturating_sub(before.bytes),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn since_subtracts_field_by_field_and_never_underflows() {
        let before = Fetched {
            blocks: 2,
            bytes: 10,
        };
        let after = Fetched {
            blocks: 5,
            bytes: 40,
        };
        assert_eq!(
            since(after, before),
            Fetched {
                blocks: 3,
                bytes: 30
            }
        );
        assert_eq!(since(before, after), Fetched::default());
    }
}
