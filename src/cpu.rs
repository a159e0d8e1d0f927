//! The request path's bound on CPU-bound jobs: [`reprise_backend::cpu`].

pub use reprise_backend::cpu::CpuPool;
