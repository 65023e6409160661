//! The fastbox side: the node-side restore of an image's golden checkpoint, as the server's
//! create path calls it (`Fastlet::restore_from` into a reserved slot), N times, each clone
//! removed outside the timed region.

use std::sync::Arc;

use anyhow::Context;
use std::time::{Duration, Instant};

use fastbox_fastlet::{Fastlet, FastletConfig, PlaceRequest, StartReport};
use fastbox_image::ResolvedImage;
use fastbox_runtime::criu_stats::RestoreStats;

use super::Run;

/// One timed restore.
#[derive(Debug)]
pub struct Sample {
    /// `restore_from`'s wall time: slot, rootfs, CRIU restore, execd ready, claim.
    pub wall: Duration,
    /// The phases of its [`StartReport`], in order.
    pub phases: Vec<(String, Duration)>,
    /// CRIU's `stats-restore` of it, when the runtime reports it.
    pub criu: Option<RestoreStats>,
    /// It restored into a spare slot made ahead (not the slot reserved for it).
    pub spare: bool,
}

/// What the fastbox side measured.
#[derive(Debug)]
pub struct Series {
    /// Building the golden checkpoint (cold start, readiness, CRIU dump): untimed set-up.
    pub template_build: Duration,
    pub samples: Vec<Sample>,
}

/// Starts the run's own fastlet (`config`: its prefix, data directory, address pool, no warm
/// pool, `run.spare_slots` spare slots), builds the template of `image` and restores it
/// `run.n` times.
pub fn series(run: &Run, config: FastletConfig, image: &ResolvedImage) -> anyhow::Result<Series> {
    let fastlet = Arc::new(Fastlet::start(config)?);
    fastlet.start_spares();
    let measured = measure(&fastlet, run, image);
    fastlet.drain_pools();
    if let Ok(fastlet) = Arc::try_unwrap(fastlet) {
        fastlet.shutdown();
    }
    measured
}

fn measure(fastlet: &Fastlet, run: &Run, image: &ResolvedImage) -> anyhow::Result<Series> {
    eprintln!("fastbox: building the golden checkpoint of {}", run.image);
    let build = Instant::now();
    let template = fastlet.template(image)?;
    let template_build = build.elapsed();
    let mut samples = Vec::with_capacity(run.n);
    for i in 0..run.n {
        let req = PlaceRequest {
            id: format!("{}-f{i}", run.prefix),
            rootfs: image.rootfs.clone(),
            entrypoint: Vec::new(),
            env: image.config.env.clone(),
            limits: Default::default(),
            disk_bytes: None,
            execd_token: format!("{:032x}", rand::random::<u128>()),
            egress_token: String::new(),
            policy: Default::default(),
            volumes: Vec::new(),
            volume_keys: Default::default(),
            credential_proxy: false,
        };
        let slot = fastlet.reserve_slot()?;
        let start = Instant::now();
        let restored = fastlet.restore_from(&template, &req, slot);
        let wall = start.elapsed();
        let (placement, report) = match restored {
            Ok(done) => done,
            Err(e) => {
                let _ = fastlet.remove(&req.id, None, Some(slot));
                return Err(anyhow::Error::from(e).context(format!("restore {i}")));
            }
        };
        let spare = placement.slot != slot;
        if spare {
            fastlet.release_slot(slot);
        }
        fastlet
            .remove(&req.id, Some(&placement), None)
            .with_context(|| format!("remove clone {i}"))?;
        samples.push(Sample {
            wall,
            phases: phases(&report),
            criu: criu_stats(&report),
            spare,
        });
    }
    Ok(Series {
        template_build,
        samples,
    })
}

fn phases(report: &StartReport) -> Vec<(String, Duration)> {
    report
        .phases
        .iter()
        .map(|(name, took)| (name.to_string(), took))
        .collect()
}

/// CRIU's own statistics of the restore, from the details of the `criu` phase (the fastlet
/// reports `stats-restore`'s forking and restore times, not its page counts).
fn criu_stats(report: &StartReport) -> Option<RestoreStats> {
    let detail = |name: &str| {
        report
            .phases
            .all()
            .find(|(n, _, detail)| *detail && *n == name)
            .map(|(_, took, _)| took.as_micros() as u64)
    };
    Some(RestoreStats {
        forking_time_us: detail("criu.forking")?,
        restore_time_us: detail("criu.restore")?,
        ..RestoreStats::default()
    })
}
