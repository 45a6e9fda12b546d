//! [`Priority`]: request classes, and who goes first when a limit is full.

/// A request's class. When a limit is full, lower classes are refused
/// first, and a higher class takes a freed slot before a lower one that
/// waited longer. Ordered: `Batch < Normal < Interactive < Critical`.
///
/// ```
/// use tollgate_budget::{Priority, displaced_by, next_to_admit};
/// use Priority::*;
///
/// assert!(Critical > Interactive && Interactive > Normal && Normal > Batch);
/// assert_eq!(Priority::default(), Normal);
///
/// // A slot frees: the interactive waiter takes it, although a batch one
/// // came first.
/// let waiting = [Batch, Interactive, Normal, Interactive];
/// assert_eq!(next_to_admit(waiting), Some(1));
///
/// // The line is full and a health check arrives: the latest batch waiter
/// // makes room. A batch arrival would itself be refused.
/// assert_eq!(displaced_by([Batch, Normal, Batch], Critical), Some(2));
/// assert_eq!(displaced_by([Batch, Normal, Batch], Batch), None);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub enum Priority {
    /// Work that can wait or be retried later (exports, reindexing).
    Batch,
    /// Requests without a class (the default).
    #[default]
    Normal,
    /// Calls a person is waiting for.
    Interactive,
    /// Requests that keep the service alive or observable (health checks,
    /// control plane).
    Critical,
}

/// Which waiter a freed slot goes to: the highest class, and among equals
/// the one that has waited longest (`waiting` is in arrival order). `None`
/// when nobody waits.
pub fn next_to_admit(waiting: impl IntoIterator<Item = Priority>) -> Option<usize> {
    let mut best: Option<(usize, Priority)> = None;
    for (i, p) in waiting.into_iter().enumerate() {
        // Strictly higher only: an equal class later in line does not pass.
        if best.is_none_or(|(_, b)| p > b) {
            best = Some((i, p));
        }
    }
    best.map(|(i, _)| i)
}

/// When the line of waiters is full and a request of class `arriving`
/// comes: the waiter to refuse to make room for it, the lowest class below
/// `arriving` and among equals the latest to arrive (`waiting` is in
/// arrival order). `None` when no waiter is of a lower class: then the
/// arriving request is the one refused.
pub fn displaced_by(
    waiting: impl IntoIterator<Item = Priority>,
    arriving: Priority,
) -> Option<usize> {
    let mut worst: Option<(usize, Priority)> = None;
    for (i, p) in waiting.into_iter().enumerate() {
        // Lower or equal: among equals the later one is refused.
        if p < arriving && worst.is_none_or(|(_, w)| p <= w) {
            worst = Some((i, p));
        }
    }
    worst.map(|(i, _)| i)
}

#[cfg(test)]
mod tests {
    use super::Priority::*;
    use super::*;

    #[test]
    fn nobody_waiting() {
        assert_eq!(next_to_admit([]), None);
        assert_eq!(displaced_by([], Critical), None);
    }

    #[test]
    fn equals_keep_their_order() {
        assert_eq!(next_to_admit([Normal, Normal, Normal]), Some(0));
        assert_eq!(displaced_by([Normal, Normal, Normal], Interactive), Some(2));
    }

    #[test]
    fn an_equal_class_never_displaces() {
        assert_eq!(displaced_by([Interactive, Critical], Interactive), None);
        assert_eq!(displaced_by([Critical], Critical), None);
    }

    #[test]
    fn the_lowest_class_is_displaced_first() {
        let waiting = [Normal, Batch, Interactive, Batch, Normal];
        assert_eq!(displaced_by(waiting, Critical), Some(3));
        assert_eq!(displaced_by(waiting, Normal), Some(3));
        assert_eq!(next_to_admit(waiting), Some(2));
    }

    #[test]
    fn against_a_sort() {
        const ALL: [Priority; 4] = [Batch, Normal, Interactive, Critical];
        // Every line of up to four waiters, every arrival.
        for len in 0..=4u32 {
            for code in 0..4usize.pow(len) {
                let line: Vec<Priority> = (0..len).map(|k| ALL[code / 4usize.pow(k) % 4]).collect();
                let mut by_rank: Vec<usize> = (0..line.len()).collect();
                by_rank.sort_by_key(|&i| (std::cmp::Reverse(line[i]), i));
                assert_eq!(
                    next_to_admit(line.iter().copied()),
                    by_rank.first().copied()
                );
                for arriving in ALL {
                    let mut lower: Vec<usize> =
                        (0..line.len()).filter(|&i| line[i] < arriving).collect();
                    lower.sort_by_key(|&i| (line[i], std::cmp::Reverse(i)));
                    assert_eq!(
                        displaced_by(line.iter().copied(), arriving),
                        lower.first().copied()
                    );
                }
            }
        }
    }
}
