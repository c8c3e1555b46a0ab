//! Which parameters of a burn model are experts and which are replicated, and names for them
//! that every rank agrees on.
//!
//! Expert parallelism shards only the experts of each [`MoeLayer`](crate::MoeLayer): every
//! other parameter (attention, norms, embeddings, the routers, the shared experts) is a
//! replica on every rank, whose gradient must be summed over the ranks before the optimizer
//! step, while an expert's gradient is already complete on the rank that holds it. The layer's
//! expert container is recognised by where burn's module visitor finds it: the `experts`
//! field of a `MoeLayer` and its experts' low-rank `adapters` (each rank holds its own
//! experts'), whatever model holds the layer.

use burn::module::{Module, ModuleMapper, ModuleVisitor, Param, ParamId};
use burn::tensor::backend::Backend;
use burn::tensor::Tensor;

/// What a float parameter is to expert parallelism.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ParamRole {
    /// A weight of a MoE layer's experts: this rank's shard, its gradient complete here
    /// (summed only over data-parallel replicas of the same experts).
    Expert,
    /// A parameter every rank holds a copy of: its gradient is summed over all ranks.
    Replicated,
    /// A tensor that is not trained (no gradient), such as DeepSeek's score bias.
    Buffer,
}

/// One float parameter of a model, in the order burn's visitor walks the model.
#[derive(Debug, Clone, PartialEq)]
pub struct ParamEntry {
    /// The module path, fields joined by `.` (`blocks.0.moe.router.weight`): the same on every
    /// rank that builds the same model, unlike burn's random [`ParamId`]s.
    pub path: String,
    /// The parameter's id in this rank's model.
    pub id: ParamId,
    /// What it is to expert parallelism.
    pub role: ParamRole,
    /// Its shape.
    pub shape: Vec<usize>,
}

impl ParamEntry {
    /// Elements in the parameter.
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }
}

/// Every float parameter of `model` with its path and role, in visiting order.
pub fn param_roles<B: Backend, M: Module<B>>(model: &M) -> Vec<ParamEntry> {
    let mut visitor = Roles {
        path: Vec::new(),
        entries: Vec::new(),
    };
    model.visit(&mut visitor);
    visitor.entries
}

/// The id a parameter at `path` gets from [`with_path_ids`]: FNV-1a of the path, the same in
/// every process and on every platform.
pub fn path_id(path: &str) -> ParamId {
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    for byte in path.bytes() {
        hash ^= u64::from(byte);
        hash = hash.wrapping_mul(0x0100_0000_01b3);
    }
    ParamId::from(hash)
}

/// `model` with every parameter's id derived from its module path ([`path_id`]), so that ids
/// agree across ranks: what burn's own gradient all-reduce and optimizer records pair
/// parameters by. The values are untouched.
pub fn with_path_ids<B: Backend, M: Module<B>>(model: M) -> M {
    model.map(&mut PathIds { path: Vec::new() })
}

/// The path stack of a visit: each entry is a field (or index) name and the type of the
/// struct that holds it, as burn's derive reports them.
struct Roles {
    path: Vec<(String, String)>,
    entries: Vec<ParamEntry>,
}

impl Roles {
    fn is_expert(&self) -> bool {
        self.path.iter().any(|(name, container)| {
            (name == "experts" || name == "adapters") && container == "Struct:MoeLayer"
        })
    }
}

impl<B: Backend> ModuleVisitor<B> for Roles {
    fn enter_module(&mut self, name: &str, container_type: &str) {
        self.path.push((name.to_string(), container_type.to_string()));
    }

    fn exit_module(&mut self, _name: &str, _container_type: &str) {
        self.path.pop();
    }

    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        let value = param.val();
        let role = if !value.is_require_grad() {
            ParamRole::Buffer
        } else if self.is_expert() {
            ParamRole::Expert
        } else {
            ParamRole::Replicated
        };
        self.entries.push(ParamEntry {
            path: join(self.path.iter().map(|(name, _)| name.as_str())),
            id: param.id,
            role,
            shape: value.dims().to_vec(),
        });
    }
}

fn join<'a>(names: impl Iterator<Item = &'a str>) -> String {
    names.collect::<Vec<_>>().join(".")
}

struct PathIds {
    path: Vec<String>,
}

impl<B: Backend> ModuleMapper<B> for PathIds {
    fn enter_module(&mut self, name: &str, _container_type: &str) {
        self.path.push(name.to_string());
    }

    fn exit_module(&mut self, _name: &str, _container_type: &str) {
        self.path.pop();
    }

    fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
        let (_, tensor, mapper) = param.consume();
        let id = path_id(&join(self.path.iter().map(String::as_str)));
        Param::from_mapped_value(id, tensor, mapper)
    }
}
