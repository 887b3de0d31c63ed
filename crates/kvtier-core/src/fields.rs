//! Report structs declared once: [`fields!`](crate::fields) writes the struct and
//! [`Fields::fields`], the (name, value) list every report (Python dicts, Prometheus, JSON) is
//! made from, so a field added to the struct is reported everywhere, under its Rust name.

/// One reported value.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Value<'a> {
    U64(u64),
    F64(f64),
    Bool(bool),
    Str(&'a str),
}

/// A type a [`fields!`](crate::fields) struct may list.
pub trait Field {
    fn value(&self) -> Value<'_>;
}

impl Field for u64 {
    fn value(&self) -> Value<'_> {
        Value::U64(*self)
    }
}

impl Field for f64 {
    fn value(&self) -> Value<'_> {
        Value::F64(*self)
    }
}

impl Field for bool {
    fn value(&self) -> Value<'_> {
        Value::Bool(*self)
    }
}

impl Field for String {
    fn value(&self) -> Value<'_> {
        Value::Str(self)
    }
}

impl Field for &'static str {
    fn value(&self) -> Value<'_> {
        Value::Str(self)
    }
}

/// A snapshot struct whose listed fields are reported by name.
pub trait Fields {
    /// Each listed field's name and value, in declaration order.
    fn fields(&self) -> Vec<(&'static str, Value<'_>)>;
}

/// Declares a struct of `pub name: T` fields (docs and attributes kept; `T` a [`Field`]: `u64`,
/// `f64`, `bool`, `String`, `&'static str`) and implements [`Fields`] for it from the same field
/// list. Fields of other types (nested reports, lists) may come first, ended by `..` before the
/// listed ones: they are declared but not listed.
#[macro_export]
macro_rules! fields {
    (
        $(#[$attr:meta])*
        $vis:vis struct $name:ident {
            $($(#[$field_attr:meta])* pub $field:ident: $ty:ty,)*
        }
    ) => {
        $crate::fields! {
            $(#[$attr])*
            $vis struct $name { .. $($(#[$field_attr])* pub $field: $ty,)* }
        }
    };
    (
        $(#[$attr:meta])*
        $vis:vis struct $name:ident {
            $($(#[$other_attr:meta])* pub $other:ident: $other_ty:ty,)*
            ..
            $($(#[$field_attr:meta])* pub $field:ident: $ty:ty,)*
        }
    ) => {
        $(#[$attr])*
        $vis struct $name {
            $($(#[$other_attr])* pub $other: $other_ty,)*
            $($(#[$field_attr])* pub $field: $ty,)*
        }

        impl $crate::fields::Fields for $name {
            fn fields(&self) -> Vec<(&'static str, $crate::fields::Value<'_>)> {
                vec![$((stringify!($field), $crate::fields::Field::value(&self.$field))),*]
            }
        }
    };
}

#[cfg(test)]
mod tests {
    use super::{Fields, Value};

    crate::fields! {
        /// Two counters.
        #[derive(Default)]
        pub struct Two {
            /// The first.
            pub first: u64,
            pub second: u64,
        }
    }

    crate::fields! {
        pub struct Mixed {
            /// Not listed: declared only.
            pub nested: Vec<u64>,
            ..
            pub label: &'static str,
            pub path: String,
            pub ratio: f64,
            pub on: bool,
            pub only: u64,
        }
    }

    #[test]
    fn every_field_is_listed_in_order_with_its_value() {
        let two = Two { first: 3, second: 7 };
        assert_eq!(two.fields(), vec![("first", Value::U64(3)), ("second", Value::U64(7))]);
        assert_eq!(Two::default().fields(), vec![("first", Value::U64(0)), ("second", Value::U64(0))]);
    }

    #[test]
    fn fields_before_the_dots_are_not_listed_and_each_type_keeps_its_value() {
        let mixed = Mixed { nested: vec![1], label: "x", path: "/d".into(), ratio: 0.5, on: true, only: 5 };
        assert_eq!(mixed.nested, vec![1]);
        assert_eq!(
            mixed.fields(),
            vec![
                ("label", Value::Str("x")),
                ("path", Value::Str("/d")),
                ("ratio", Value::F64(0.5)),
                ("on", Value::Bool(true)),
                ("only", Value::U64(5)),
            ]
        );
    }
}
