// SPDX-License-Identifier: MIT OR Apache-2.0
//! Backend behaviour: one test body per property, run on every backend that can run it.

use half::bf16;
use metrale_core::DevicePtr;
use metrale_gpu_runtime::{
    GpuBackend, GpuError, HostBackend, MockBackend, Recorded, Stream, launch_kernel,
};
use metrale_kernels::ops::{Add, RmsNorm};
use metrale_kernels::{Kernel, KernelAbi, names};

fn backends() -> Vec<Box<dyn GpuBackend>> {
    vec![
        Box::new(HostBackend::new(1 << 26)),
        Box::new(MockBackend::new()),
    ]
}

fn upload_bf16(gpu: &dyn GpuBackend, v: &[f32]) -> DevicePtr {
    let data: Vec<bf16> = v.iter().map(|&x| bf16::from_f32(x)).collect();
    let p = gpu.alloc(data.len() * 2).unwrap();
    gpu.copy_h2d(bytemuck::cast_slice(&data), p).unwrap();
    p
}

fn download_bf16(gpu: &dyn GpuBackend, p: DevicePtr, n: usize) -> Vec<f32> {
    let mut bytes = vec![0u8; n * 2];
    gpu.copy_d2h(p, &mut bytes).unwrap();
    bytemuck::pod_collect_to_vec::<u8, bf16>(&bytes)
        .into_iter()
        .map(f32::from)
        .collect()
}

#[test]
fn memory_round_trips_and_is_accounted() {
    for gpu in backends() {
        let gpu = gpu.as_ref();
        let free_before = gpu.free_memory().unwrap();
        let p = gpu.alloc(1000).unwrap();
        assert_eq!(p.0 % 256, 0, "{}", gpu.kind());
        assert_eq!(gpu.free_memory().unwrap(), free_before - 1000);
        let data: Vec<u8> = (0..1000).map(|i| (i % 251) as u8).collect();
        gpu.copy_h2d(&data, p).unwrap();
        let q = gpu.alloc(1000).unwrap();
        gpu.copy_d2d(p, q, 1000, gpu.default_stream()).unwrap();
        gpu.memset(q.offset(10), 7, 5, gpu.default_stream())
            .unwrap();
        let mut back = vec![0u8; 1000];
        gpu.copy_d2h(p, &mut back).unwrap();
        assert_eq!(back, data, "{}", gpu.kind());
        gpu.free(p).unwrap();
        gpu.free(q).unwrap();
        assert_eq!(gpu.free_memory().unwrap(), free_before);
        assert!(gpu.total_memory().unwrap() >= free_before);
        assert!(
            gpu.free(p).is_err(),
            "{}: double free must fail",
            gpu.kind()
        );
        assert!(
            gpu.copy_h2d(&[1, 2], DevicePtr(8)).is_err(),
            "{}: wild pointer",
            gpu.kind()
        );
        let mut pinned = gpu.alloc_host_pinned(64).unwrap();
        pinned[63] = 9;
        assert_eq!(pinned.len(), 64);
    }
}

#[test]
fn host_runs_references_and_replays_graphs() {
    let gpu = HostBackend::new(1 << 26);
    let add = gpu.kernel(Add::NAME).unwrap();
    let a = upload_bf16(&gpu, &[1.0, 2.0, 3.0]);
    let b = upload_bf16(&gpu, &[10.0, 20.0, 30.0]);
    let s = gpu.default_stream();
    // Capture `a += b` twice; nothing runs until the graph is launched.
    gpu.begin_capture(s).unwrap();
    launch_kernel(&gpu, add, &Add { out: a, a, b, n: 3 }, s).unwrap();
    launch_kernel(&gpu, add, &Add { out: a, a, b, n: 3 }, s).unwrap();
    assert!(
        matches!(gpu.copy_h2d(&[0; 2], a), Err(GpuError::Capture(_))),
        "host copies are not capturable"
    );
    let graph = gpu.end_capture(s).unwrap();
    assert_eq!(download_bf16(&gpu, a, 3), vec![1.0, 2.0, 3.0]);
    gpu.launch_graph(graph, s).unwrap();
    assert_eq!(download_bf16(&gpu, a, 3), vec![21.0, 42.0, 63.0]);
    gpu.launch_graph(graph, s).unwrap();
    assert_eq!(download_bf16(&gpu, a, 3), vec![41.0, 82.0, 123.0]);
    assert!(matches!(gpu.end_capture(s), Err(GpuError::Capture(_))));
}

#[test]
fn host_reports_bad_launches() {
    let gpu = HostBackend::new(1 << 26);
    let norm = gpu.kernel(RmsNorm::NAME).unwrap();
    let x = upload_bf16(&gpu, &[1.0; 4]);
    // The output buffer is too small for rows * cols: the reference must refuse, not scribble.
    let out = gpu.alloc(2).unwrap();
    let k = RmsNorm {
        out,
        input: x,
        weight: x,
        rows: 1,
        cols: 4,
        eps: 1e-6,
    };
    let err = launch_kernel(&gpu, norm, &k, gpu.default_stream()).unwrap_err();
    assert!(
        err.to_string().contains("outside every allocation"),
        "{err}"
    );
    // Arguments that do not match the signature name the kernel and the argument.
    let err = gpu
        .launch(
            norm,
            &k.launch_config(),
            &k.args()[..3],
            gpu.default_stream(),
        )
        .unwrap_err();
    assert!(err.to_string().contains("rmsnorm_bf16"), "{err}");
    assert!(
        gpu.launch(
            metrale_gpu_runtime::KernelHandle(99),
            &k.launch_config(),
            &k.args(),
            gpu.default_stream()
        )
        .is_err()
    );
    assert!(gpu.synchronize(Stream(5)).is_err());
    let s2 = gpu.create_stream().unwrap();
    gpu.synchronize(s2).unwrap();
}

#[test]
fn mock_records_launch_shape_and_order() {
    let gpu = MockBackend::new();
    let norm = gpu.kernel(names::rmsnorm::RMSNORM_BF16).unwrap();
    let add = gpu.kernel(names::elementwise::ADD_BF16).unwrap();
    let p = gpu.alloc(4096).unwrap();
    let s = gpu.create_stream().unwrap();
    let k = RmsNorm {
        out: p,
        input: p,
        weight: p,
        rows: 3,
        cols: 64,
        eps: 1e-6,
    };
    launch_kernel(&gpu, norm, &k, s).unwrap();
    launch_kernel(
        &gpu,
        add,
        &Add {
            out: p,
            a: p,
            b: p,
            n: 70000,
        },
        s,
    )
    .unwrap();
    let launches = gpu.launches();
    assert_eq!(launches.len(), 2);
    match &launches[0] {
        Recorded::Launch {
            kernel,
            config,
            args,
            stream,
            carveout,
        } => {
            assert_eq!(*kernel, names::rmsnorm::RMSNORM_BF16);
            assert_eq!(*carveout, None);
            assert_eq!(config.grid, [3, 1, 1]);
            assert_eq!(*args, k.args());
            assert_eq!(*stream, s);
        }
        other => panic!("{other:?}"),
    }
    match &launches[1] {
        Recorded::Launch { config, .. } => {
            assert_eq!(config.grid, [274, 1, 1], "ceil(70000 / 256) blocks")
        }
        other => panic!("{other:?}"),
    }
    // A captured launch is recorded when the graph replays, after a GraphLaunch marker.
    gpu.clear();
    gpu.begin_capture(s).unwrap();
    launch_kernel(
        &gpu,
        add,
        &Add {
            out: p,
            a: p,
            b: p,
            n: 1,
        },
        s,
    )
    .unwrap();
    let g = gpu.end_capture(s).unwrap();
    assert!(gpu.recorded().is_empty());
    gpu.launch_graph(g, s).unwrap();
    let rec = gpu.recorded();
    assert_eq!(rec.len(), 2);
    assert_eq!(rec[0], Recorded::GraphLaunch(g));
}

#[test]
fn mock_can_lack_a_module() {
    let gpu = MockBackend::new().without_module("rope");
    let err = gpu
        .kernel(names::rope::ROPE_NEOX_BF16)
        .unwrap_err()
        .to_string();
    assert!(err.contains("rope"), "{err}");
    assert!(gpu.kernel(names::argmax::ARGMAX_F32).is_ok());
}

#[test]
fn cuda_without_a_driver_is_an_error_not_a_panic() {
    // On machines with no NVIDIA driver (CI) this checks the error path; on a GPU machine it
    // checks that probing works.
    match metrale_gpu_runtime::probe::probe_driver() {
        Ok(info) => assert!(!info.devices.is_empty()),
        Err(e) => assert!(
            matches!(e, GpuError::NoDriver | GpuError::NoDevice(_)),
            "{e}"
        ),
    }
}
