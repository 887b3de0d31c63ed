//! Snapshots of `u64` counters declared once: [`counters!`](crate::counters) writes the struct
//! and [`Counters::counters`], the (name, value) list every report (Python dicts, Prometheus,
//! JSON) is made from, so a field added to the struct is reported everywhere.

/// A snapshot struct whose fields are all `u64` counters or gauges.
pub trait Counters {
    /// Each field's name and value, in declaration order.
    fn counters(&self) -> Vec<(&'static str, u64)>;
}

/// Declares a struct of `pub name: u64` fields (docs and attributes kept) and implements
/// [`Counters`] for it from the same field list. Fields of other types may come first, ended by
/// `..` before the counters: they are declared but not listed.
#[macro_export]
macro_rules! counters {
    (
        $(#[$attr:meta])*
        $vis:vis struct $name:ident {
            $($(#[$field_attr:meta])* pub $field:ident: u64,)*
        }
    ) => {
        $crate::counters! {
            $(#[$attr])*
            $vis struct $name { .. $($(#[$field_attr])* pub $field: u64,)* }
        }
    };
    (
        $(#[$attr:meta])*
        $vis:vis struct $name:ident {
            $($(#[$other_attr:meta])* pub $other:ident: $other_ty:ty,)*
            ..
            $($(#[$field_attr:meta])* pub $field:ident: u64,)*
        }
    ) => {
        $(#[$attr])*
        $vis struct $name {
            $($(#[$other_attr])* pub $other: $other_ty,)*
            $($(#[$field_attr])* pub $field: u64,)*
        }

        impl $crate::counters::Counters for $name {
            fn counters(&self) -> Vec<(&'static str, u64)> {
                vec![$((stringify!($field), self.$field)),*]
            }
        }
    };
}

#[cfg(test)]
mod tests {
    use super::Counters;

    crate::counters! {
        /// Two counters.
        #[derive(Default)]
        pub struct Two {
            /// The first.
            pub first: u64,
            pub second: u64,
        }
    }

    crate::counters! {
        pub struct Mixed {
            /// Not a counter: declared, not listed.
            pub label: &'static str,
            ..
            pub only: u64,
        }
    }

    #[test]
    fn every_field_is_listed_in_order_with_its_value() {
        let two = Two { first: 3, second: 7 };
        assert_eq!(two.counters(), vec![("first", 3), ("second", 7)]);
        assert_eq!(Two::default().counters(), vec![("first", 0), ("second", 0)]);
    }

    #[test]
    fn fields_before_the_counters_are_not_listed() {
        let mixed = Mixed { label: "x", only: 5 };
        assert_eq!(mixed.label, "x");
        assert_eq!(mixed.counters(), vec![("only", 5)]);
    }
}
