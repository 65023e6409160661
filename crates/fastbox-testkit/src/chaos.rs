//! What the chaos tests share: their seed and length from the environment, and the seeded
//! order of their fault kinds.

use rand::Rng;

/// The seed when `FASTBOX_CHAOS_SEED` does not give one.
pub const DEFAULT_SEED: u64 = 20261206;

/// `FASTBOX_CHAOS_SEED` (default [`DEFAULT_SEED`]) and `FASTBOX_CHAOS_SECONDS` (default
/// `default_seconds`).
pub fn seed_and_seconds(default_seconds: u64) -> (u64, u64) {
    let number = |name: &str| std::env::var(name).ok().and_then(|s| s.parse().ok());
    (
        number("FASTBOX_CHAOS_SEED").unwrap_or(DEFAULT_SEED),
        number("FASTBOX_CHAOS_SECONDS").unwrap_or(default_seconds),
    )
}

/// Shuffles `items` in place (Fisher-Yates): the same order for the same generator state.
pub fn seeded_order<T>(items: &mut [T], rng: &mut impl Rng) {
    for i in (1..items.len()).rev() {
        items.swap(i, rng.random_range(0..=i));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::SeedableRng;
    use rand::rngs::StdRng;

    #[test]
    fn one_seed_one_order_and_nothing_lost() {
        let order = |seed| {
            let mut kinds = [1, 2, 3, 4, 5];
            seeded_order(&mut kinds, &mut StdRng::seed_from_u64(seed));
            kinds
        };
        assert_eq!(order(7), order(7));
        let mut sorted = order(7);
        sorted.sort();
        assert_eq!(sorted, [1, 2, 3, 4, 5]);
        assert!(
            (0..20).any(|seed| order(seed) != order(7)),
            "the seed matters"
        );
    }
}
