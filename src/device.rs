//! Device selection: `--device` names one of the backends compiled in (cargo features). This is
//! the one place that names the NdArray and LibTorch backends, which Burn deprecates in favour of
//! Flex (we keep them: users asked for them).
#![allow(deprecated)]

use anyhow::{Result, anyhow, bail};
use burn::tensor::Device;
use diffzoo_models::AttentionImpl;

/// The device strings `--device` accepts, with the cargo feature each needs.
pub const DEVICES: [(&str, &str); 7] = [
    ("cpu", "flex or ndarray"),
    ("flex", "flex"),
    ("ndarray", "ndarray"),
    ("wgpu", "wgpu"),
    ("tch", "tch"),
    ("tch-cuda:N", "tch"),
    ("cuda:N", "cuda"),
];

/// The single-device backends compiled into this binary, as `--device` strings. `cuda:0` is
/// listed with the `cuda` feature (built only where a GPU is); `tch-cuda:0` never (the `tch`
/// feature is built with a CPU LibTorch in CI).
pub fn compiled() -> Vec<&'static str> {
    vec![
        #[cfg(feature = "flex")]
        "flex",
        #[cfg(feature = "ndarray")]
        "ndarray",
        #[cfg(feature = "wgpu")]
        "wgpu",
        #[cfg(feature = "tch")]
        "tch",
        #[cfg(feature = "cuda")]
        "cuda:0",
    ]
}

/// `Ok(device)` when `feature` is compiled in, else an error saying which feature to enable.
macro_rules! backend {
    ($spec:expr, $feature:literal, $make:expr) => {{
        #[cfg(feature = $feature)]
        let device: Result<Device> = Ok($make);
        #[cfg(not(feature = $feature))]
        let device: Result<Device> = Err(anyhow!(
            "device `{}` needs the `{}` cargo feature: rebuild with `--features {}`",
            $spec,
            $feature,
            $feature
        ));
        device
    }};
}

/// Parses the devices of data-parallel training (`--devices`). Burn 0.22.1 has collective
/// operations (the all-reduce of gradients) only on CubeCL CUDA, so more than one device must all
/// be distinct `cuda:N` devices; one device is simply [`parse`]d.
/// `configure` sets each device up (its float dtype) before it is started.
pub fn parse_data_parallel(
    specs: &[String],
    configure: impl Fn(&mut Device, &str) -> Result<()>,
) -> Result<Vec<Device>> {
    if let [spec] = specs {
        return Ok(vec![parse_as(spec, |d| configure(d, spec))?]);
    }
    let list = specs.join(",");
    let mut seen = Vec::new();
    for spec in specs {
        let (kind, index) = split(spec).map_err(|e| anyhow!("--devices {list}: {e}"))?;
        if kind != "cuda" {
            bail!(
                "--devices {list}: data-parallel training all-reduces gradients with collective \
                 operations, which Burn 0.22.1 has only on CubeCL CUDA (`cuda:N`), not on `{spec}`; \
                 train on one device with --device {spec}"
            );
        }
        if seen.contains(&index) {
            bail!("--devices {list}: `{spec}` names a GPU listed before it");
        }
        seen.push(index);
    }
    specs
        .iter()
        .map(|spec| {
            parse_as(spec, |d| configure(d, spec)).map_err(|e| anyhow!("--devices {list}: {e}"))
        })
        .collect()
}

/// A device string's kind and index (`cuda:1` → `("cuda", Some(1))`).
fn split(spec: &str) -> Result<(&str, Option<usize>)> {
    Ok(match spec.split_once(':') {
        Some((kind, index)) => {
            let index = index
                .parse()
                .map_err(|_| anyhow!("device `{spec}`: `{index}` is not a device index"))?;
            (kind, Some(index))
        }
        None => (spec, None),
    })
}

/// Parses a device string and checks that the device starts. `cpu` is the default CPU backend
/// (Flex, measured faster than NdArray on a training step; see the book's Backends chapter).
pub fn parse(spec: &str) -> Result<Device> {
    parse_as(spec, |_| Ok(()))
}

/// Parses a device string, sets the device up with `configure` (its float dtype: a device is
/// configured before its first tensor, which the start check makes) and checks that it starts.
pub fn parse_as(spec: &str, configure: impl FnOnce(&mut Device) -> Result<()>) -> Result<Device> {
    let mut device = named(spec)?;
    configure(&mut device)?;
    match split(spec)?.0 {
        "cpu" | "flex" | "ndarray" | "tch" => Ok(device),
        _ => start(spec, device),
    }
}

/// A device that is compiled in may still fail to start — LibTorch CUDA on a CPU LibTorch,
/// CUDA without a driver, WGPU without an adapter — and its backend panics then. One tiny
/// tensor made and read back tells: a panic becomes an error naming the device and the fix.
fn start(spec: &str, device: Device) -> Result<Device> {
    use std::panic::{AssertUnwindSafe, catch_unwind, set_hook, take_hook};
    let hook = take_hook();
    set_hook(Box::new(|_| {}));
    let started = catch_unwind(AssertUnwindSafe(|| {
        burn::tensor::Tensor::<1>::zeros([1], &device).into_data();
    }));
    set_hook(hook);
    let Err(panic) = started else {
        return Ok(device);
    };
    let why = panic
        .downcast_ref::<String>()
        .map(String::as_str)
        .or_else(|| panic.downcast_ref::<&str>().copied())
        .unwrap_or("its backend panicked");
    let fix = match split(spec)?.0 {
        "tch-cuda" => {
            "this binary's LibTorch has no CUDA (`bash .ci/setup tch` assembles a CPU one): point \
             LIBTORCH at a CUDA LibTorch 2.9.0 and rebuild with --features tch, or train on \
             `--device tch` (CPU) or `cuda:N` (CubeCL)"
        }
        "cuda" => {
            "no usable NVIDIA driver or GPU of that index (`nvidia-smi` lists them); use \
             --device cpu on this machine"
        }
        _ => {
            "no graphics adapter: on a machine without a GPU install Mesa's Vulkan driver \
             (`bash .ci/setup wgpu`), or use --device cpu"
        }
    };
    bail!(
        "device `{spec}` is compiled in but does not start ({}): {fix}",
        why.lines().next().unwrap_or(why).trim()
    )
}

/// Whether the device reads weight matrices kept in bf16 while computing in f32 (`--dtype bf16`):
/// the CPU's Flex backend (its few-row products widen them as they stream), LibTorch and CUDA
/// (a cast per product). NdArray has no bf16 tensors and WGSL no bf16 type.
pub fn reads_bf16_weights(spec: &str) -> bool {
    matches!(split(spec), Ok(("flex" | "tch" | "tch-cuda" | "cuda", _)))
        || (spec == "cpu" && cfg!(feature = "flex"))
}

/// Whether the device is the CPU's Flex backend.
pub fn is_flex(spec: &str) -> bool {
    spec == "flex" || (spec == "cpu" && cfg!(feature = "flex"))
}

/// The device a device string names, unchecked.
fn named(spec: &str) -> Result<Device> {
    match split(spec)? {
        #[cfg(feature = "flex")]
        ("cpu", None) => backend!(spec, "flex", Device::flex()),
        #[cfg(not(feature = "flex"))]
        ("cpu", None) => backend!(spec, "ndarray", Device::ndarray()),
        ("flex", None) => backend!(spec, "flex", Device::flex()),
        ("ndarray", None) => backend!(spec, "ndarray", Device::ndarray()),
        ("wgpu", None) => backend!(
            spec,
            "wgpu",
            Device::wgpu(burn::tensor::DeviceKind::DefaultDevice)
        ),
        ("tch", None) => backend!(spec, "tch", Device::libtorch()),
        ("tch-cuda", Some(_i)) => backend!(spec, "tch", Device::libtorch_cuda(_i)),
        ("cuda", Some(_i)) => backend!(spec, "cuda", Device::cuda(_i)),
        _ => bail!(
            "unknown device `{spec}`: expected one of {} (compiled in: {})",
            DEVICES.map(|(d, _)| d).join(", "),
            compiled().join(", ")
        ),
    }
}

/// The attention of a pass without a backward (inference, validation) on the device `spec` names,
/// computing in f32; `None`: the recipe's.
///
/// On Flex the explicit path whatever the recipe trains with: without a backward to keep maps
/// for, it computes each block of queries against its keys in one product and one softmax pass
/// (`attention::blocks`, f32 only), memory growing with S as flash's does, where flash rescales a
/// running sum per block of keys. Prefill of 2,051 tokens at SmolLM2-135M's shape on the AVX2
/// EPYC, six interleaved pairs of runs before and after: median 230 → 277 tokens/s. Elsewhere
/// (and in other dtypes) the explicit path would hold S×S maps, so the recipe's choice stands.
pub fn inference_attention(spec: &str) -> Option<AttentionImpl> {
    is_flex(spec).then_some(AttentionImpl::Explicit)
}
