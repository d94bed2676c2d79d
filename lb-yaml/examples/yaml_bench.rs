//! Time to typed objects: the block reader against serde YAML libraries, on the same
//! documents (the agent's document split) and the same target types (k8s-openapi
//! Service and EndpointSlice). One thread, so the ratio does not depend on how many
//! CPUs the other builds on the machine leave free; the agent splits the documents
//! across threads the same way whichever reader it uses.
//!
//! ```sh
//! cargo build --release -p lb-bench
//! target/release/lb-bench manifests --services 10000 --out /tmp/yaml10k
//! cargo run --release -p lb-yaml --example yaml_bench -- /tmp/yaml10k/others.yaml 5
//! ```

use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::Service;
use k8s_openapi::api::discovery::v1::EndpointSlice;
use lb_yaml::{block as block_yaml, split_documents};

#[derive(Default, PartialEq)]
struct Typed {
    services: Vec<Service>,
    slices: Vec<EndpointSlice>,
}

/// What the block reader hands the agent: the type picked from `(apiVersion, kind)`
/// while reading, no second pass. Not boxed: each object moves straight into its
/// Vec, and a box would add an allocation the agent does not make.
type Object = lb_yaml::Kinded<Service, EndpointSlice>;

type Reader = fn(&[&str]) -> Result<Typed, String>;

#[derive(Clone, Copy)]
enum Kind {
    Service,
    Slice,
    Other,
}

/// The best case for a library without a kind-tagged entry point: the type picked
/// by a scan of the document's top-level lines (cheap next to parsing it), then one
/// typed read. Reading a head struct first would parse every document twice.
fn kind_of(doc: &str) -> Kind {
    let (mut api_version, mut kind) = ("", "");
    for line in doc.lines() {
        if let Some(v) = line.strip_prefix("apiVersion: ") {
            api_version = v.trim();
        } else if let Some(v) = line.strip_prefix("kind: ") {
            kind = v.trim();
        }
    }
    match (api_version, kind) {
        ("v1", "Service") => Kind::Service,
        ("discovery.k8s.io/v1", "EndpointSlice") => Kind::Slice,
        _ => Kind::Other,
    }
}

macro_rules! typed_with {
    ($name:literal, $from_str:path) => {
        (
            $name,
            (|docs: &[&str]| {
                let mut typed = Typed::default();
                for doc in docs {
                    match kind_of(doc) {
                        Kind::Service => typed
                            .services
                            .push($from_str(doc).map_err(|e| format!("{}: {e}", $name))?),
                        Kind::Slice => typed
                            .slices
                            .push($from_str(doc).map_err(|e| format!("{}: {e}", $name))?),
                        Kind::Other => {}
                    }
                }
                Ok(typed)
            }) as Reader,
        )
    };
}

fn block_reader(docs: &[&str]) -> Result<Typed, String> {
    let mut typed = Typed::default();
    for doc in docs {
        match block_yaml::from_str::<Object>(doc).ok_or("block reader: outside its subset")? {
            Object::Service(s) => typed.services.push(s),
            Object::Slice(s) => typed.slices.push(s),
            Object::Other => {}
        }
    }
    Ok(typed)
}

fn median(mut times: Vec<Duration>) -> Duration {
    times.sort();
    times[times.len() / 2]
}

fn main() {
    let mut args = std::env::args().skip(1);
    let file = args
        .next()
        .expect("usage: yaml_bench FILE.yaml [RUNS] [LIBRARY...]");
    let runs: usize = args
        .next()
        .map_or(5, |r| r.parse().expect("RUNS: a number"));
    let only: Vec<String> = args.collect();
    let text = std::fs::read_to_string(&file).expect("readable UTF-8 file");
    let split = split_documents(&text);
    let docs: Vec<&str> = split.iter().map(|d| d.text.as_ref()).collect();
    println!(
        "{file}: {:.1} MB, {} documents, {runs} runs each, one thread",
        text.len() as f64 / 1e6,
        docs.len()
    );

    let readers: [(&str, Reader); 6] = [
        ("block reader", block_reader),
        typed_with!("serde_yaml 0.9 (deprecated)", serde_yaml::from_str),
        typed_with!("serde_yaml_ng", serde_yaml_ng::from_str),
        typed_with!("serde_norway", serde_norway::from_str),
        typed_with!("serde-saphyr", serde_saphyr::from_str),
        typed_with!("noyalib", noyalib::from_str),
    ];
    let reference = block_reader(&docs).expect("the bench's manifests are block YAML");
    let mut base = None;
    for (name, read) in readers {
        if !only.is_empty()
            && name != "block reader"
            && !only.iter().any(|o| name.starts_with(o.as_str()))
        {
            continue;
        }
        let mut times = Vec::with_capacity(runs);
        let mut outcome = Ok(());
        for _ in 0..runs {
            let start = Instant::now();
            let typed = read(&docs);
            times.push(start.elapsed());
            outcome = match typed {
                Ok(t) if t == reference => Ok(()),
                Ok(t) => Err(format!(
                    "read differently ({} Services, {} slices)",
                    t.services.len(),
                    t.slices.len()
                )),
                Err(e) => Err(e),
            };
        }
        let m = median(times.clone());
        let base = *base.get_or_insert(m);
        println!(
            "{name:30} median {:7.1} ms  ({:.2}x the block reader)  runs {:?}{}",
            m.as_secs_f64() * 1e3,
            m.as_secs_f64() / base.as_secs_f64(),
            times.iter().map(|t| t.as_millis()).collect::<Vec<_>>(),
            outcome
                .err()
                .map_or(String::new(), |e| format!("  ERROR: {e}"))
        );
    }
}
