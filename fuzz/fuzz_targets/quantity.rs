//! Kubernetes quantities (`fastbox_api::quantity`) on arbitrary strings: parsing never panics,
//! what parses formats and parses back to the same value (as text and as JSON), and the cpu
//! and byte scales agree.
#![no_main]

use fastbox_api::quantity::{Bytes, CpuMillis, parse_bytes, parse_cpu_millis};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let text = String::from_utf8_lossy(data);
    let s = text.as_ref();
    let cpu = parse_cpu_millis(s);
    let bytes = parse_bytes(s);

    if let Ok(m) = cpu {
        assert!(m > 0, "{s:?}: zero cpu accepted");
        let shown = CpuMillis(m).to_string();
        assert_eq!(
            shown.parse::<CpuMillis>(),
            Ok(CpuMillis(m)),
            "{s:?} -> {shown:?}"
        );
        // A value in millicores is in units after rounding up to a whole unit.
        assert_eq!(bytes, Ok(m.div_ceil(1000)), "{s:?}: cpu {m}m");
    }
    if let Ok(b) = bytes {
        assert!(b > 0, "{s:?}: zero bytes accepted");
        let shown = Bytes(b).to_string();
        assert_eq!(shown.parse::<Bytes>(), Ok(Bytes(b)), "{s:?} -> {shown:?}");
    }

    // Through serde, as resourceLimits arrive: the same verdicts as the parsers'.
    let json = serde_json::to_string(s).expect("a string serializes");
    let from_json = serde_json::from_str::<CpuMillis>(&json);
    assert_eq!(from_json.is_ok(), cpu.is_ok(), "{s:?}");
    if let (Ok(v), Ok(m)) = (&from_json, &cpu) {
        assert_eq!(v.0, *m);
        let back = serde_json::to_string(v).expect("serializes");
        assert_eq!(serde_json::from_str::<CpuMillis>(&back).ok(), Some(*v));
    }
    let from_json = serde_json::from_str::<Bytes>(&json);
    assert_eq!(from_json.is_ok(), bytes.is_ok(), "{s:?}");
    if let (Ok(v), Ok(b)) = (&from_json, &bytes) {
        assert_eq!(v.0, *b);
        let back = serde_json::to_string(v).expect("serializes");
        assert_eq!(serde_json::from_str::<Bytes>(&back).ok(), Some(*v));
    }
    // Bare JSON numbers, as Kubernetes allows.
    if let Ok(n) = s.parse::<u64>() {
        assert_eq!(
            serde_json::from_str::<Bytes>(&n.to_string())
                .ok()
                .map(|b| b.0),
            bytes.ok()
        );
    }
});
