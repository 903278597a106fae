//! Tests of the configuration: environment parsing and its errors.

use super::*;
use std::collections::HashMap;

fn with(vars: &[(&str, &str)]) -> Result<NexarConfig, ConfigError> {
    let map: HashMap<String, String> = vars.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
    NexarConfig::from_lookup(|k| map.get(k).cloned())
}

#[test]
fn every_variable_is_read() {
    let c = with(&[
        ("NEXAR_WORLD_SIZE", "8"),
        ("NEXAR_SEED_ADDR", "10.1.2.3:7000"),
        ("NEXAR_LISTEN_ADDR", "127.0.0.1:0"),
        ("NEXAR_OP_TIMEOUT_MS", "2500"),
        ("NEXAR_MAX_MESSAGE_BYTES", "64M"),
        ("NEXAR_MAX_UNMATCHED_MESSAGES", "7"),
        ("NEXAR_MAX_UNMATCHED_BYTES", "1GiB"),
        ("NEXAR_LANE_CAPACITY", "3"),
        ("NEXAR_HEARTBEAT_INTERVAL_MS", "100"),
        ("NEXAR_HEARTBEAT_TIMEOUT_MS", "700"),
        ("NEXAR_RECOVERY_POLICY", "automatic"),
        ("NEXAR_MIN_WORLD_SIZE", "2"),
        ("NEXAR_MAX_WORLD_SIZE", "16"),
        ("NEXAR_SEGMENT_BYTES", "4M"),
        ("NEXAR_LANE_CONGESTION", "Reno"),
        ("NEXAR_LANE_AES", "Ring"),
        ("NEXAR_LANE_CIPHER", "AES_128_GCM"),
    ])
    .unwrap();
    assert_eq!(c.heartbeat_timeout, Duration::from_millis(700));
    assert_eq!(c.recovery_policy, RecoveryPolicy::Automatic);
    assert_eq!(c.chaos, None, "no fault injection unless a NEXAR_CHAOS_* variable asks");
    assert_eq!((c.min_world_size, c.max_world_size), (2, 16));
    assert_eq!(c.world_size, Some(8));
    assert_eq!(c.seed_addr, Some("10.1.2.3:7000".parse().unwrap()));
    assert_eq!(c.op_timeout, Duration::from_millis(2500));
    assert_eq!(c.max_message_bytes, 64 << 20);
    assert_eq!(c.max_unmatched_messages, 7);
    assert_eq!(c.max_unmatched_bytes, 1 << 30);
    assert_eq!(c.lane_capacity, 3);
    assert_eq!(c.segment_bytes, 4 << 20);
    assert_eq!(c.lane_congestion, LaneCongestion::Named("reno".into()));
    assert_eq!(c.lane_aes, crate::config::LaneAes::Ring);
    assert_eq!(c.lane_cipher, crate::config::LaneCipher::Aes128Gcm);
}

#[test]
fn the_two_level_algorithms_can_be_pinned_from_the_environment() {
    let c =
        with(&[("NEXAR_ALLREDUCE_ALGORITHM", "hierarchical"), ("NEXAR_BROADCAST_ALGORITHM", "hierarchical")]).unwrap();
    for pinned in [c.allreduce_algorithm, c.broadcast_algorithm] {
        assert!(matches!(pinned, Some(crate::proto::algo::Algorithm::Hierarchical { .. })), "{pinned:?}");
    }
}

#[test]
fn invalid_values_name_their_variable() {
    for (var, val) in [
        ("NEXAR_WORLD_SIZE", "0"),
        ("NEXAR_WORLD_SIZE", "four"),
        ("NEXAR_SEED_ADDR", "localhost"),
        ("NEXAR_OP_TIMEOUT_MS", "0"),
        ("NEXAR_OP_TIMEOUT_MS", "-5"),
        ("NEXAR_MAX_MESSAGE_BYTES", "5G"),
        ("NEXAR_MAX_UNMATCHED_MESSAGES", "0"),
        ("NEXAR_TOKEN", "not-a-token"),
        ("NEXAR_SOCKET_BUFFER_BYTES", "lots"),
        ("NEXAR_ALLREDUCE_ALGORITHM", "binomial_tree"),
        ("NEXAR_BARRIER_ALGORITHM", "fast"),
        ("NEXAR_RECOVERY_POLICY", "pray"),
        ("NEXAR_HEARTBEAT_TIMEOUT_MS", "500"),
        ("NEXAR_MIN_WORLD_SIZE", "0"),
        ("NEXAR_CHAOS_LOSS", "1.5"),
        ("NEXAR_TOPOLOGY", "k_regular:x"),
        ("NEXAR_BIND", "socket"),
        ("NEXAR_LANE_CONGESTION", "cubic; reno"),
        ("NEXAR_LANE_CONGESTION", "a-name-far-too-long-for-the-kernel"),
        ("NEXAR_LANE_AES", "openssl"),
        ("NEXAR_LANE_CIPHER", "chacha20-poly1305"),
    ] {
        let err = with(&[(var, val)]).unwrap_err();
        assert!(err.to_string().contains(var), "{var}={val}: {err}");
    }
}

#[test]
fn the_builder_sets_what_it_names_and_checks_like_the_environment() {
    let built = NexarConfig::builder()
        .world_size(4)
        .token("nexar1.t.f")
        .op_timeout(Duration::from_secs(7))
        .bulk_encryption(false)
        .host_id("node-3")
        .lane_congestion(LaneCongestion::System)
        .build()
        .unwrap();
    let assigned = NexarConfig {
        world_size: Some(4),
        token: Some("nexar1.t.f".into()),
        op_timeout: Duration::from_secs(7),
        bulk_encryption: false,
        host_id: Some("node-3".into()),
        lane_congestion: LaneCongestion::System,
        ..NexarConfig::default()
    };
    assert!(built == assigned);
    // A config in hand keeps what it had.
    let again = built.clone().into_builder().shared_memory(false).build().unwrap();
    assert_eq!((again.world_size, again.op_timeout, again.shared_memory), (Some(4), Duration::from_secs(7), false));
    // The same relations as from_env, named by their variables.
    let late =
        NexarConfig::builder().heartbeat_interval(Duration::from_secs(2)).heartbeat_timeout(Duration::from_secs(1));
    assert!(matches!(late.build(), Err(ConfigError::InvalidVar { var: "NEXAR_HEARTBEAT_TIMEOUT_MS", .. })));
    let small = NexarConfig::builder().world_size(8).max_world_size(4).build();
    assert!(matches!(small, Err(ConfigError::InvalidVar { var: "NEXAR_MAX_WORLD_SIZE", .. })));
    assert!(NexarConfig::builder().max_message_bytes(0).build().is_err());
}
