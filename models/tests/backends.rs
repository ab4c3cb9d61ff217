//! The same weights give the same outputs on every backend compiled in (Flex is the
//! reference).

mod common;

use burn::tensor::Device;
use common::{CASES, Io, assert_close, backends, case_config, load_model, tolerance};

#[test]
fn every_backend_matches_flex_on_every_variant() {
    let backends = backends();
    assert!(
        backends.len() >= 2,
        "build with both `flex` and `ndarray` to compare backends"
    );
    for (case, attention, d_model, heads, kv_heads) in CASES {
        let io = Io::load(case);
        let config = case_config(attention, d_model, heads, kv_heads);
        let logits = |device: &Device| {
            let model = load_model(case, &config, device);
            model
                .forward(io.int::<2>("tokens", device))
                .to_device(&Device::flex())
        };
        let reference = logits(&Device::flex());
        for (name, device) in &backends {
            assert_close(
                &format!("{case}: {name} vs flex"),
                logits(device),
                reference.clone(),
                tolerance(name),
                1e-5,
            );
        }
    }
}
