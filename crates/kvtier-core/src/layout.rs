//! placeholder: filled by the layout work
