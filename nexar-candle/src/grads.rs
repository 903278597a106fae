//! Moving candle tensors in and out of nexar's buckets: gradients read straight from their CPU
//! storage, averages made into tensors, variables broadcast by element type.

use candle_core::{CpuStorage, DType, Device, Storage, Tensor, Var};
use nexar::ddp::{Averaged, Ddp as Reducer, GradElement};
use nexar::{bf16, f16};

use crate::Error;

/// nexar's element type for a candle one.
pub(crate) fn nexar_dtype(name: &str, dtype: DType) -> Result<nexar::DType, Error> {
    Ok(match dtype {
        DType::F32 => nexar::DType::F32,
        DType::F64 => nexar::DType::F64,
        DType::F16 => nexar::DType::F16,
        DType::BF16 => nexar::DType::BF16,
        other => return Err(Error::UnsupportedDtype { name: name.to_string(), dtype: other }),
    })
}

fn cpu_only(name: &str, device: &Device) -> Result<(), Error> {
    match device {
        Device::Cpu => Ok(()),
        other => Err(Error::UnsupportedDevice { name: name.to_string(), device: format!("{:?}", other.location()) }),
    }
}

/// Hands gradient `g` of parameter `index` to the reducer: copied once, from the tensor's
/// storage when it is contiguous, else through a contiguous copy.
pub(crate) fn hand_over(reducer: &mut Reducer, index: usize, name: &str, g: &Tensor) -> Result<(), Error> {
    cpu_only(name, g.device())?;
    if !g.is_contiguous() {
        return hand_over(reducer, index, name, &g.contiguous()?);
    }
    let (storage, layout) = g.storage_and_layout();
    let Storage::Cpu(cpu) = &*storage else {
        return Err(Error::UnsupportedDevice { name: name.to_string(), device: "a device other than the CPU".into() });
    };
    let (start, end) = layout.contiguous_offsets().unwrap_or((0, 0));
    // The reducer checks the length and the element type against the registration.
    match cpu {
        CpuStorage::F32(v) => reducer.ready_index(index, &v[start..end])?,
        CpuStorage::F64(v) => reducer.ready_index(index, &v[start..end])?,
        CpuStorage::F16(v) => reducer.ready_index(index, &v[start..end])?,
        CpuStorage::BF16(v) => reducer.ready_index(index, &v[start..end])?,
        _ => return Err(Error::UnsupportedDtype { name: name.to_string(), dtype: g.dtype() }),
    }
    Ok(())
}

/// The averaged gradient of parameter `index` as a tensor shaped like `var`.
pub(crate) fn tensor_of(averaged: &Averaged<'_>, index: usize, name: &str, var: &Var) -> Result<Tensor, Error> {
    fn make<T: GradElement + candle_core::WithDType>(
        averaged: &Averaged<'_>,
        index: usize,
        var: &Var,
    ) -> Result<Tensor, Error> {
        Ok(Tensor::from_slice(averaged.get_index::<T>(index)?, var.shape(), var.device())?)
    }
    match var.dtype() {
        DType::F32 => make::<f32>(averaged, index, var),
        DType::F64 => make::<f64>(averaged, index, var),
        DType::F16 => make::<f16>(averaged, index, var),
        DType::BF16 => make::<bf16>(averaged, index, var),
        other => Err(Error::UnsupportedDtype { name: name.to_string(), dtype: other }),
    }
}

/// Broadcasts `vars` from `root`: one collective per element type, over their values
/// flattened, then each variable set to what arrived.
pub(crate) async fn broadcast(reducer: &Reducer, vars: &[Var], root: usize) -> Result<(), Error> {
    for (i, v) in vars.iter().enumerate() {
        cpu_only(&format!("#{i}"), v.device())?;
    }
    broadcast_typed::<f32>(reducer, vars, DType::F32, root).await?;
    broadcast_typed::<f64>(reducer, vars, DType::F64, root).await?;
    broadcast_typed::<f16>(reducer, vars, DType::F16, root).await?;
    broadcast_typed::<bf16>(reducer, vars, DType::BF16, root).await?;
    Ok(())
}

async fn broadcast_typed<T: nexar::Element + candle_core::WithDType>(
    reducer: &Reducer,
    vars: &[Var],
    dtype: DType,
    root: usize,
) -> Result<(), Error> {
    let of_type: Vec<&Var> = vars.iter().filter(|v| v.dtype() == dtype).collect();
    let mut values: Vec<Vec<T>> =
        of_type.iter().map(|v| v.as_tensor().flatten_all()?.to_vec1::<T>()).collect::<Result<_, _>>()?;
    let mut parts: Vec<&mut [T]> = values.iter_mut().map(|v| &mut v[..]).collect();
    // Every rank calls this for every type, with an empty list where it has none: the
    // collectives stay in step, and a rank whose list differs gets an error naming the part.
    reducer.broadcast(root, &mut parts).await?;
    if reducer.comm().rank() != root {
        for (var, v) in of_type.iter().zip(values) {
            var.set(&Tensor::from_vec(v, var.shape(), var.device())?)?;
        }
    }
    Ok(())
}
