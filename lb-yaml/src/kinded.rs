//! A document typed by its `(apiVersion, kind)` while the block reader reads it:
//! a Service, an EndpointSlice, or anything else (skipped without being built).
//! Generic over the two types, so this crate needs no Kubernetes types of its own.

use std::borrow::Cow;
use std::marker::PhantomData;

use serde::de::{Deserialize, Deserializer, EnumAccess, IgnoredAny, VariantAccess, Visitor};

use crate::block::KIND_TAGGED;

/// `Service` is `v1 Service`, `Slice` is `discovery.k8s.io/v1 EndpointSlice`.
#[derive(Debug, PartialEq)]
pub enum Kinded<S, E> {
    Service(S),
    Slice(E),
    Other,
}

impl<'de, S: Deserialize<'de>, E: Deserialize<'de>> Deserialize<'de> for Kinded<S, E> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_enum(KIND_TAGGED, &[], KindedVisitor(PhantomData))
    }
}

struct KindedVisitor<S, E>(PhantomData<(S, E)>);

impl<'de, S: Deserialize<'de>, E: Deserialize<'de>> Visitor<'de> for KindedVisitor<S, E> {
    type Value = Kinded<S, E>;

    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("a Kubernetes object")
    }

    fn visit_enum<A: EnumAccess<'de>>(self, data: A) -> Result<Self::Value, A::Error> {
        let ((api_version, kind), object): ((Cow<str>, Cow<str>), _) = data.variant()?;
        Ok(match (api_version.as_ref(), kind.as_ref()) {
            ("v1", "Service") => Kinded::Service(object.newtype_variant()?),
            ("discovery.k8s.io/v1", "EndpointSlice") => Kinded::Slice(object.newtype_variant()?),
            _ => {
                object.newtype_variant::<IgnoredAny>()?;
                Kinded::Other
            }
        })
    }
}
