//! Where in a stage tensor a value sits, as named coordinates: what every message and report gives.

use serde::ser::SerializeMap;
use serde::{Deserialize, Serialize};

/// A position inside a stage tensor: the flat index and named coordinates (layer, token, head, dim, and
/// page/slot/split details where they apply), in axis order.
#[derive(Debug, Clone, PartialEq)]
pub struct Position {
    pub coords: Vec<(String, usize)>,
}

impl Serialize for Position {
    fn serialize<S: serde::Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        let mut m = s.serialize_map(Some(self.coords.len()))?;
        for (k, v) in &self.coords {
            m.serialize_entry(k, v)?;
        }
        m.end()
    }
}

// Keeps the keys in the document's order (axis order), so that a report read back is written again
// byte for byte (`mla-diff merge`).
impl<'de> Deserialize<'de> for Position {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        struct Coords;
        impl<'de> serde::de::Visitor<'de> for Coords {
            type Value = Position;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a map of axis names to indices")
            }
            fn visit_map<A: serde::de::MapAccess<'de>>(
                self,
                mut m: A,
            ) -> std::result::Result<Position, A::Error> {
                let mut coords = Vec::new();
                while let Some(kv) = m.next_entry::<String, usize>()? {
                    coords.push(kv);
                }
                Ok(Position { coords })
            }
        }
        d.deserialize_map(Coords)
    }
}

impl std::fmt::Display for Position {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let parts: Vec<String> = self
            .coords
            .iter()
            .map(|(k, v)| format!("{k} {v}"))
            .collect();
        f.write_str(&parts.join(", "))
    }
}
