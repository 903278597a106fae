//! Walks over a burn module: its float parameters in visit order (named by module path), their
//! gradients taken out of a `GradientsParams` and averages put back, and parameter values read
//! and written for a broadcast.

use burn::module::{Module, ModuleMapper, ModuleVisitor, Param, ParamId};
use burn::optim::GradientsParams;
use burn::tensor::{DType, Device, Tensor, TensorData};

use crate::Error;

/// A float parameter of the model, as a walk found it.
#[derive(Clone, Debug)]
pub(crate) struct Found {
    /// The module path (`layers.0.weight`), unique within the model.
    pub name: String,
    pub shape: Vec<usize>,
    pub dtype: DType,
    /// Whether it requires a gradient (only these are registered for averaging).
    pub trainable: bool,
}

/// The module path of the parameter being visited, kept from `enter_module`/`exit_module`.
#[derive(Default)]
struct Path(Vec<String>);

impl Path {
    fn enter(&mut self, name: &str) {
        self.0.push(name.to_string());
    }

    fn exit(&mut self) {
        self.0.pop();
    }

    fn name(&self) -> String {
        self.0.join(".")
    }
}

/// Names a nexar registration can take: a module path, or `param{i}` where it is empty (a bare
/// `Param` as the model), with `#i` appended where two parameters share a path.
fn unique_names(found: &mut [Found]) {
    let mut seen = std::collections::HashSet::new();
    for (i, f) in found.iter_mut().enumerate() {
        if f.name.is_empty() {
            f.name = format!("param{i}");
        }
        if !seen.insert(f.name.clone()) {
            f.name = format!("{}#{i}", f.name);
            seen.insert(f.name.clone());
        }
    }
}

/// Every float parameter of `model`, in visit order (deterministic from the module's structure).
pub(crate) fn float_params<M: Module>(model: &M) -> Vec<Found> {
    struct Collect {
        path: Path,
        out: Vec<Found>,
    }
    impl ModuleVisitor for Collect {
        fn enter_module(&mut self, name: &str, _container: &str) {
            self.path.enter(name);
        }
        fn exit_module(&mut self, _name: &str, _container: &str) {
            self.path.exit();
        }
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            let tensor = param.val();
            self.out.push(Found {
                name: self.path.name(),
                shape: tensor.dims().to_vec(),
                dtype: tensor.dtype(),
                trainable: tensor.is_require_grad(),
            });
        }
    }
    let mut collect = Collect { path: Path::default(), out: Vec::new() };
    model.visit(&mut collect);
    unique_names(&mut collect.out);
    collect.out
}

/// Puts an averaged gradient into a `GradientsParams` as a tensor of rank `D` (a function
/// pointer made where `D` is known, inside the visit).
type Register = fn(&mut GradientsParams, ParamId, TensorData, &Device, DType);

fn register<const D: usize>(grads: &mut GradientsParams, id: ParamId, data: TensorData, device: &Device, dtype: DType) {
    grads.register(id, Tensor::<D>::from_data(data, (device, dtype)));
}

/// A trainable parameter's gradient, taken out of `GradientsParams` for averaging.
pub(crate) struct Taken {
    pub id: ParamId,
    pub shape: Vec<usize>,
    pub dtype: DType,
    /// Where the average goes: the gradient's device, or the parameter's (without autodiff)
    /// where it got none.
    pub device: Device,
    /// The gradient read back to the host; `None` where the parameter got none.
    pub grad: Option<TensorData>,
    pub register: Register,
}

impl Taken {
    /// Puts `average` back into `grads` for this parameter.
    pub fn put(&self, grads: &mut GradientsParams, average: TensorData) {
        (self.register)(grads, self.id, average, &self.device, self.dtype)
    }
}

/// Takes the gradients of `model`'s trainable parameters out of `grads`, in visit order.
pub(crate) fn take_grads<M: Module>(model: &M, grads: &mut GradientsParams) -> Result<Vec<Taken>, Error> {
    struct Take<'a> {
        path: Path,
        grads: &'a mut GradientsParams,
        out: Vec<Taken>,
        failed: Option<Error>,
    }
    impl ModuleVisitor for Take<'_> {
        fn enter_module(&mut self, name: &str, _container: &str) {
            self.path.enter(name);
        }
        fn exit_module(&mut self, _name: &str, _container: &str) {
            self.path.exit();
        }
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            let tensor = param.val();
            if !tensor.is_require_grad() || self.failed.is_some() {
                return;
            }
            let (shape, dtype) = (tensor.dims().to_vec(), tensor.dtype());
            let (device, grad) = match self.grads.remove::<D>(param.id) {
                Some(g) => {
                    let device = g.device();
                    match g.try_into_data() {
                        Ok(data) => (device, Some(data)),
                        Err(source) => {
                            self.failed = Some(Error::Read { name: self.path.name(), source: source.into() });
                            return;
                        }
                    }
                }
                None => (tensor.device().without_autodiff(), None),
            };
            self.out.push(Taken { id: param.id, shape, dtype, device, grad, register: register::<D> });
        }
    }
    let mut take = Take { path: Path::default(), grads, out: Vec::new(), failed: None };
    model.visit(&mut take);
    match take.failed {
        Some(e) => Err(e),
        None => Ok(take.out),
    }
}

/// The values of every float parameter of `model`, in visit order, read back to the host.
pub(crate) fn read_values<M: Module>(model: &M) -> Result<Vec<(String, TensorData)>, Error> {
    struct Read {
        path: Path,
        out: Vec<(String, TensorData)>,
        failed: Option<Error>,
    }
    impl ModuleVisitor for Read {
        fn enter_module(&mut self, name: &str, _container: &str) {
            self.path.enter(name);
        }
        fn exit_module(&mut self, _name: &str, _container: &str) {
            self.path.exit();
        }
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            if self.failed.is_some() {
                return;
            }
            match param.val().try_into_data() {
                Ok(data) => self.out.push((self.path.name(), data)),
                Err(source) => self.failed = Some(Error::Read { name: self.path.name(), source: source.into() }),
            }
        }
    }
    let mut read = Read { path: Path::default(), out: Vec::new(), failed: None };
    model.visit(&mut read);
    match read.failed {
        Some(e) => Err(e),
        None => Ok(read.out),
    }
}

/// Gives every float parameter of `model` the values in `values` (in visit order, one for each),
/// keeping its id, device, element type and whether it requires a gradient.
pub(crate) fn write_values<M: Module>(model: M, values: Vec<TensorData>) -> M {
    struct Write {
        values: std::vec::IntoIter<TensorData>,
    }
    impl ModuleMapper for Write {
        fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
            let Some(data) = self.values.next() else { return param };
            param.map(|old| {
                // The device carries the autodiff association and the checkpointing strategy.
                let new = Tensor::<D>::from_data(data, (&old.device(), old.dtype()));
                if old.is_require_grad() { new.require_grad() } else { new }
            })
        }
    }
    model.map(&mut Write { values: values.into_iter() })
}
