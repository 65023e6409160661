//! Runs blocking runtime work from async code on a fresh OS thread that exits afterwards.
//! Namespace operations act on the calling thread, and tokio reuses its threads (blocking pool
//! included), so runtime calls never run on a tokio thread.

use tokio::sync::oneshot;

/// Runs `f` on a new thread named `name` and awaits its result.
pub async fn run<T, F>(name: &str, f: F) -> T
where
    F: FnOnce() -> T + Send + 'static,
    T: Send + 'static,
{
    let (tx, rx) = oneshot::channel();
    std::thread::Builder::new()
        .name(name.to_string())
        .spawn(move || {
            let _ = tx.send(f());
        })
        .expect("spawn a runtime thread");
    rx.await.expect("runtime thread panicked")
}

#[cfg(test)]
mod tests {
    #[tokio::test]
    async fn runs_on_another_thread() {
        let here = std::thread::current().id();
        let there = super::run("t", || std::thread::current().id()).await;
        assert_ne!(here, there);
    }
}
