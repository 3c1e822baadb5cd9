//! The admin API and what operators watch: endpoints, metrics, drain and logs, bounded answers,
//! floods, the dashboard.

pub mod bounded;
pub mod closing;
pub mod dashboard;
pub mod dashboard_api;
pub mod flood;
pub mod issue;
pub mod openapi;
pub mod operate;
pub mod placeholders;
pub mod python_client;
