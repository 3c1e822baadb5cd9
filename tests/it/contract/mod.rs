//! The lease contract's published vectors and the fuzz targets' seed corpora.

pub mod budget;
pub mod conformance;
pub mod fuzz_corpus;
