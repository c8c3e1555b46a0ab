//! The gradient sync this example used before the library had one (issue 34), kept only as
//! the comparator of BENCHMARKS.md's gradient-sync measurement (`--grad-sync host-f64`):
//! every replicated gradient copied to the host as f64, one vector all-gathered whole by every
//! rank (`Communicator::all_reduce_sum`), and registered back parameter by parameter.

use burn::module::{AutodiffModule, ModuleVisitor, Param, ParamId};
use burn::optim::GradientsParams;
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::{Tensor, TensorData};
use mpipemoe::parallel::{param_roles, ParamRole};
use mpipemoe::Communicator;

/// Collects the gradients of replicated parameters, in visiting order.
struct Collect<'a> {
    grads: &'a mut GradientsParams,
    skip: &'a [ParamId],
    values: Vec<f64>,
}

impl<B: AutodiffBackend> ModuleVisitor<B> for Collect<'_> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        // Buffers (the score bias) are not trained: no gradient to sum.
        if self.skip.contains(&param.id) || !param.val().is_require_grad() {
            return;
        }
        let count: usize = param.val().dims().iter().product();
        match self.grads.remove::<B::InnerBackend, D>(param.id) {
            Some(g) => self
                .values
                .extend(g.into_data().convert::<f64>().into_vec::<f64>().expect("f64")),
            // A rank whose tokens never reached a parameter contributes zero to its sum.
            None => self.values.extend(std::iter::repeat_n(0.0, count)),
        }
    }
}

/// Puts the summed gradients back, in the same visiting order.
struct Register<'a> {
    grads: &'a mut GradientsParams,
    skip: &'a [ParamId],
    values: std::vec::IntoIter<f64>,
}

impl<B: AutodiffBackend> ModuleVisitor<B> for Register<'_> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        if self.skip.contains(&param.id) || !param.val().is_require_grad() {
            return;
        }
        let dims = param.val().dims();
        let count: usize = dims.iter().product();
        let values: Vec<f64> = self.values.by_ref().take(count).collect();
        let data = TensorData::new(values, dims).convert::<B::FloatElem>();
        let device = param.val().device();
        self.grads
            .register::<B::InnerBackend, D>(param.id, Tensor::from_data(data, &device));
    }
}

/// Sums the gradients of every replicated parameter over the ranks (one all-reduce), so
/// every replica takes the same step: the gradient of the global-batch loss.
pub fn all_reduce_replicated<B: AutodiffBackend, M: AutodiffModule<B>>(
    model: &M,
    grads: &mut GradientsParams,
    comm: &dyn Communicator,
) -> mpipemoe::Result<()> {
    // Everything but the replicated parameters: the experts and the buffers.
    let skip: Vec<ParamId> = param_roles::<B, M>(model)
        .into_iter()
        .filter(|e| e.role != ParamRole::Replicated)
        .map(|e| e.id)
        .collect();
    let mut collect = Collect {
        grads,
        skip: &skip,
        values: Vec::new(),
    };
    model.visit(&mut collect);
    let mut values = collect.values;
    comm.all_reduce_sum(&mut values)?;
    model.visit(&mut Register {
        grads,
        skip: &skip,
        values: values.into_iter(),
    });
    Ok(())
}
