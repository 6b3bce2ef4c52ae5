//! `router._router`: the Rust router exposed to Python. Configuration crosses the boundary as
//! JSON of `RouterConfig`, so the Rust struct stays the single declaration of every default.

use pyo3::exceptions::{PyRuntimeError, PyValueError};
use pyo3::prelude::*;
use splitserve_router::{RouterConfig, StartError};

/// JSON of `RouterConfig::default()`: every flag's default, declared once in Rust.
#[pyfunction]
fn defaults_json() -> String {
    serde_json::to_string(&RouterConfig::default()).expect("the default config serializes")
}

/// Parses and validates a config; raises ValueError naming what to fix.
#[pyfunction]
fn validate_config(config_json: &str) -> PyResult<String> {
    let cfg = RouterConfig::from_json(config_json).map_err(|e| PyValueError::new_err(e.to_string()))?;
    Ok(serde_json::to_string(&cfg).expect("a parsed config serializes"))
}

/// Runs the router until SIGTERM/SIGINT; the GIL is released meanwhile.
#[pyfunction]
fn run(py: Python<'_>, config_json: &str) -> PyResult<()> {
    let cfg = RouterConfig::from_json(config_json).map_err(|e| PyValueError::new_err(e.to_string()))?;
    py.detach(move || splitserve_router::run(cfg)).map_err(|e| match e {
        StartError::Config(c) => PyValueError::new_err(c.to_string()),
        other => PyRuntimeError::new_err(other.to_string()),
    })
}

#[pymodule]
fn _router(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(defaults_json, m)?)?;
    m.add_function(wrap_pyfunction!(validate_config, m)?)?;
    m.add_function(wrap_pyfunction!(run, m)?)?;
    Ok(())
}
