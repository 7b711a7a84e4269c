"""Device meshes: named axes, the links between devices, and the hardware of each device.

A mesh file (YAML) describes a cluster: hosts, devices per host, the link inside a host
(NVLink) and between hosts (InfiniBand), and named axes listed outer to inner. Each axis gets
the link it actually crosses, so the fastest links serve the innermost axes. A mesh may be
*virtual*: a description of a cluster that is not present, used for planning and for
compile-only checks on as many simulated CPU devices.

The mesh files shipped with spmd (``spmd/meshes/*.yaml``) load by name: ``load_mesh("cpu-8")``.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np
import yaml

from spmd.errors import MeshError
from spmd.cluster.devices import CPU_COUNT_FLAG, NO_GPU_ADVICE, gpu_absence, set_cpu_device_count
from spmd.cluster.hardware import DeviceSpec, device_spec

PLATFORMS = ("cpu", "gpu")
#: the mesh files shipped inside the package, loaded by name (``cpu-8``, ``a100-2x8``)
BUNDLED_DIR = Path(__file__).resolve().parent.parent / "meshes"
_TOP_KEYS = {
    "name", "device", "platform", "hosts", "devices_per_host", "links", "axes", "virtual",
    "distributed",
}
_LINK_KEYS = {"bandwidth", "latency"}
_DIST_KEYS = {"coordinator", "num_processes", "process_id"}


@dataclasses.dataclass(frozen=True)
class Link:
    """A link that one mesh axis communicates over: per-device bandwidth (bytes/s), latency (s)."""

    bandwidth: float
    latency: float


@dataclasses.dataclass(frozen=True)
class DistributedConfig:
    """Where the processes of a multi-process run meet (``jax.distributed.initialize``)."""

    coordinator: str
    num_processes: int
    process_id: int


@dataclasses.dataclass(frozen=True)
class DeviceMesh:
    """A cluster as the planner sees it: named axes (outer to inner), links, device hardware.

    >>> mesh = make_mesh({"data": 2, "model": 4}, bandwidth={"data": 25e9, "model": 300e9},
    ...                  device="a100-40gb", virtual=True)
    >>> mesh.shape, mesh.size, mesh.link(("data", "model")).bandwidth
    ({'data': 2, 'model': 4}, 8, 25000000000.0)
    """

    axis_names: tuple[str, ...]
    axis_sizes: tuple[int, ...]
    links: Mapping[str, Link]
    device: DeviceSpec
    platform: str = "cpu"
    virtual: bool = False
    name: str = "mesh"
    hosts: int = 1
    distributed: DistributedConfig | None = None
    source: str | None = None
    #: positions (in the process group's device order) of this mesh's devices, row-major
    #: over its axes; None: the first ``size`` devices (a whole mesh). Set by ``submesh``.
    device_ids: tuple[int, ...] | None = None
    #: the platform of the devices this mesh's compile stands in for: a GPU mesh as XLA:CPU
    #: compiles it on simulated devices, for a check (``Plan.priced_on("cpu")``), whose
    #: matmul copies are made at their readers (``spmd.runtime.constrain``). None: itself.
    stands_in_for: str | None = None

    @property
    def shape(self) -> dict[str, int]:
        return dict(zip(self.axis_names, self.axis_sizes))

    @property
    def size(self) -> int:
        return math.prod(self.axis_sizes)

    def axis_size(self, axes: str | tuple[str, ...] | None) -> int:
        """Number of devices a tensor dimension is split over when sharded on ``axes``."""
        if axes is None:
            return 1
        if isinstance(axes, str):
            axes = (axes,)
        return math.prod(self.shape[a] for a in axes)

    def link(self, axes: str | tuple[str, ...]) -> Link:
        """The link a collective over ``axes`` runs at: the slowest of them."""
        if isinstance(axes, str):
            axes = (axes,)
        chosen = [self.links[a] for a in axes]
        return Link(min(l.bandwidth for l in chosen), max(l.latency for l in chosen))

    def submesh(self, sizes: Mapping[str, int], offset: Mapping[str, int] | None = None
                ) -> "DeviceMesh":
        """The sub-grid of this mesh with ``sizes`` devices along the named axes (the other
        axes whole), at block ``offset[axis]`` along each (default 0): a stage's devices.
        Each axis keeps its link, so a submesh inside one host still rides NVLink.

        >>> mesh = make_mesh({"data": 2, "model": 4}, virtual=True)
        >>> sub = mesh.submesh({"data": 1}, offset={"data": 1})
        >>> sub.shape, sub.device_ids
        ({'data': 1, 'model': 4}, (4, 5, 6, 7))

        Raises:
          MeshError: an unknown axis, a size that does not divide the axis, or an offset
            outside it.
        """
        offset = dict(offset or {})
        for name in list(sizes) + list(offset):
            if name not in self.shape:
                raise MeshError(f"submesh of {self.name!r}: unknown axis {name!r}; axes: "
                                f"{list(self.axis_names)}")
        new_sizes, starts = [], []
        for name, size in zip(self.axis_names, self.axis_sizes):
            want = _number(sizes.get(name, size), f"submesh of {self.name!r}: {name}", int)
            if size % want:
                raise MeshError(f"submesh of {self.name!r}: axis {name} of size {size} cannot "
                                f"be split into blocks of {want}; use a divisor of {size}")
            block = int(offset.get(name, 0))
            if not 0 <= block < size // want:
                raise MeshError(f"submesh of {self.name!r}: offset {block} of axis {name} is "
                                f"outside its {size // want} blocks of {want}")
            new_sizes.append(want)
            starts.append(block * want)
        parent = np.asarray(self.device_ids if self.device_ids is not None
                            else range(self.size)).reshape(self.axis_sizes)
        ids = parent[tuple(slice(s, s + n) for s, n in zip(starts, new_sizes))]
        per_host = self.size // self.hosts
        where = ", ".join(f"{n} {s}:{s + k}" for n, s, k in zip(self.axis_names, starts, new_sizes)
                          if k != self.shape[n])
        return dataclasses.replace(
            self, axis_sizes=tuple(new_sizes), name=f"{self.name}[{where}]" if where else self.name,
            hosts=len({int(i) // per_host for i in ids.flat}),
            device_ids=tuple(int(i) for i in ids.flat))

    def sharding_mesh(self):
        """The jax mesh shardings of a plan refer to: the concrete one when this process has
        its devices, else, for a virtual mesh, the abstract one (planning for a cluster that
        is not here). A mesh that is not virtual must have its devices: without them its
        plan could not run, so this is the first place that says so (MeshError)."""
        try:
            return self.jax_mesh()
        except MeshError:
            if not self.virtual:
                raise
            return self.abstract_mesh()

    def abstract_mesh(self):
        """The jax AbstractMesh (names and sizes, Auto axes): enough for planning and caching."""
        from jax.sharding import AbstractMesh, AxisType

        return AbstractMesh(self.axis_sizes, self.axis_names,
                            axis_types=(AxisType.Auto,) * len(self.axis_names))

    @property
    def compile_backend(self) -> str:
        """The jax backend this mesh's programs compile on: a virtual mesh's on simulated CPU
        devices (compile-only checks), a real one's on its platform's."""
        return "cpu" if self.virtual else self.platform

    @property
    def stand_in(self) -> bool:
        """Whether this mesh's compile stands in for another platform's devices (a virtual
        GPU mesh on simulated CPU devices; ``stands_in_for``)."""
        return self.stands_in_for is not None or self.compile_backend != self.platform

    def jax_mesh(self):
        """The concrete jax Mesh over the devices of this process group (Auto axis types).

        A virtual mesh uses as many CPU devices (compile-only checks); a real one needs exactly
        its size in devices of its platform; a submesh the devices its ``device_ids`` name.
        """
        import jax
        from jax.sharding import AxisType

        backend = self.compile_backend
        try:
            devices = jax.devices(backend)
        except RuntimeError:
            devices = []
        ids = self.device_ids if self.device_ids is not None else tuple(range(self.size))
        whole = self.device_ids is None and not self.virtual
        if len(devices) <= max(ids) or (whole and len(devices) != self.size):
            have = f"{len(devices)} {backend} device(s)"
            if backend == "cpu":
                hint = f"start the process with XLA_FLAGS={CPU_COUNT_FLAG}={self.size}"
            elif not devices:
                hint = f"no GPU is present; {NO_GPU_ADVICE}"
            else:
                hint = "run on a cluster of that size, or load it with virtual=True"
            raise MeshError(
                f"mesh {self.name!r}{_from(self.source)} needs {self.size} {backend} devices "
                f"(axes {self.shape}) but this process sees {have}; {hint}"
            )
        # The devices in process-group order, reshaped row-major (what jax.make_mesh does
        # with CPU and GPU devices), so device_ids index the same order in every mesh.
        grid = np.array([devices[i] for i in ids], dtype=object).reshape(self.axis_sizes)
        return jax.sharding.Mesh(grid, self.axis_names,
                                 axis_types=(AxisType.Auto,) * len(self.axis_names))

    def describe(self) -> str:
        axes = ", ".join(
            f"{n}={s} ({self.links[n].bandwidth / 1e9:g} GB/s, {self.links[n].latency * 1e6:g} us)"
            for n, s in zip(self.axis_names, self.axis_sizes)
        )
        kind = "virtual " if self.virtual else ""
        return f"{kind}mesh {self.name}: {self.size} x {self.device.name} [{axes}]"


def _from(source: str | None) -> str:
    return f" (from {source})" if source else ""


def _number(value: Any, where: str, kind: type = float, positive: bool = True) -> Any:
    """Parse a number from YAML, where ``300e9`` arrives as a string."""
    try:
        out = kind(float(value)) if kind is int else kind(value)
    except (TypeError, ValueError):
        raise MeshError(f"{where}: expected a number, got {value!r}") from None
    if kind is int and float(value) != out:
        raise MeshError(f"{where}: expected an integer, got {value!r}")
    if positive and out <= 0:
        raise MeshError(f"{where}: must be positive, got {value!r}")
    return out


def _link(raw: Any, where: str) -> Link:
    if not isinstance(raw, Mapping):
        raise MeshError(f"{where}: expected a mapping with keys bandwidth, latency; got {raw!r}")
    unknown = sorted(set(raw) - _LINK_KEYS)
    missing = sorted(_LINK_KEYS - set(raw))
    if unknown or missing:
        raise MeshError(f"{where}: unknown keys {unknown}, missing keys {missing}; "
                        f"valid keys: bandwidth (bytes/s), latency (s)")
    return Link(_number(raw["bandwidth"], f"{where}.bandwidth"),
                _number(raw["latency"], f"{where}.latency", positive=False))


def _axis_links(names: tuple[str, ...], sizes: tuple[int, ...], devices_per_host: int,
                intra: Link, inter: Link) -> dict[str, Link]:
    """Give each axis the link it crosses: axes whose groups stay inside one host use ``intra``.

    Axes are laid out outer to inner (row-major device order), so an axis stays inside a host
    when the product of its size and all inner sizes is at most ``devices_per_host``.
    """
    links: dict[str, Link] = {}
    inner = 1
    for name, size in reversed(list(zip(names, sizes))):
        inner *= size
        links[name] = intra if (inner <= devices_per_host or size == 1) else inter
    return links


def bundled_meshes() -> dict[str, Path]:
    """The mesh files shipped with spmd, by name (the file's stem), sorted.

    >>> "cpu-8" in bundled_meshes()
    True
    """
    return {p.stem: p for p in sorted(BUNDLED_DIR.glob("*.yaml"))}


def mesh_file(name_or_path: str | os.PathLike) -> Path:
    """The file a mesh argument names: an existing path, else a bundled mesh's name (with or
    without ``.yaml``), so ``--mesh cpu-8`` works from any directory.

    Raises:
      MeshError: neither a file nor a bundled name; the message lists the bundled names.
    """
    path = Path(name_or_path)
    if path.exists():
        return path
    bundled = bundled_meshes()
    name = path.name.removesuffix(".yaml")
    if path.parent == Path(".") and name in bundled:
        return bundled[name]
    raise MeshError(f"{name_or_path}: no such mesh file, nor a bundled mesh name; bundled: "
                    f"{', '.join(bundled)} (see `spmd meshes`)")


def load_mesh(path: str | os.PathLike, virtual: bool | None = None) -> DeviceMesh:
    """Read a mesh file, or a bundled mesh by name (``"cpu-8"``, ``"a100-2x8"``; see
    ``bundled_meshes``). ``virtual`` overrides the file's own ``virtual:`` key.

    A CPU mesh sets the simulated device count itself, when jax's backend has not started yet.

    >>> load_mesh("a100-2x8", virtual=True).shape
    {'data': 2, 'model': 8}
    """
    path = mesh_file(path)
    where = str(path)
    try:
        text = path.read_text()
    except OSError as err:
        raise MeshError(f"{where}: cannot read mesh file: {err.strerror}") from None
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as err:
        raise MeshError(f"{where}: malformed YAML: {err}") from None
    if not isinstance(raw, Mapping):
        raise MeshError(f"{where}: expected a mapping at the top level, got {type(raw).__name__}")
    unknown = sorted(set(raw) - _TOP_KEYS)
    if unknown:
        raise MeshError(f"{where}: unknown key(s) {unknown}; valid keys: {', '.join(sorted(_TOP_KEYS))}")
    for key in ("device", "axes"):
        if key not in raw:
            raise MeshError(f"{where}: missing key {key!r}")
    platform = raw.get("platform", "gpu")
    if platform not in PLATFORMS:
        raise MeshError(f"{where}: platform: {platform!r} is not one of {PLATFORMS}")
    axes_raw = raw["axes"]
    if not isinstance(axes_raw, Mapping) or not axes_raw:
        raise MeshError(f"{where}: axes: expected a non-empty mapping of axis name to size "
                        f"(outer to inner), e.g. {{data: 2, model: 4}}")
    hosts = _number(raw.get("hosts", 1), f"{where}: hosts", int)
    names: list[str] = []
    sizes: list[int] = []
    overrides: dict[str, Link] = {}
    for name, spec in axes_raw.items():
        key = f"{where}: axes.{name}"
        if isinstance(spec, Mapping):
            extra = sorted(set(spec) - {"size"} - _LINK_KEYS)
            if extra or "size" not in spec:
                raise MeshError(f"{key}: expected keys size and optionally bandwidth, latency; "
                                f"got {sorted(spec)}")
            sizes.append(_number(spec["size"], f"{key}.size", int))
            if _LINK_KEYS & set(spec):  # an axis with its own link: both figures required
                overrides[str(name)] = _link({k: spec[k] for k in _LINK_KEYS if k in spec}, key)
        else:
            sizes.append(_number(spec, key, int))
        names.append(str(name))
    total = math.prod(sizes)
    devices_per_host = _number(raw.get("devices_per_host", total // hosts or 1),
                               f"{where}: devices_per_host", int)
    if hosts * devices_per_host != total:
        raise MeshError(f"{where}: axes {dict(zip(names, sizes))} hold {total} devices but "
                        f"hosts x devices_per_host = {hosts} x {devices_per_host} = "
                        f"{hosts * devices_per_host}")
    links_raw = raw.get("links", {})
    if not isinstance(links_raw, Mapping) or set(links_raw) - {"intra_host", "inter_host"}:
        raise MeshError(f"{where}: links: expected keys intra_host and (for hosts > 1) "
                        f"inter_host, got {links_raw!r}")
    if "intra_host" not in links_raw and len(overrides) < len(names):
        raise MeshError(f"{where}: missing key 'links.intra_host' (bandwidth, latency)")
    intra = _link(links_raw["intra_host"], f"{where}: links.intra_host") if "intra_host" in links_raw else None
    inter = intra
    if hosts > 1 and len(overrides) < len(names):  # else every axis has its own link
        if "inter_host" not in links_raw:
            raise MeshError(f"{where}: hosts is {hosts}, so 'links.inter_host' is required")
        inter = _link(links_raw["inter_host"], f"{where}: links.inter_host")
    links = _axis_links(tuple(names), tuple(sizes), devices_per_host, intra, inter) if intra else {}
    links.update(overrides)
    distributed = _distributed(raw.get("distributed"), where)
    mesh = DeviceMesh(
        axis_names=tuple(names), axis_sizes=tuple(sizes), links=links,
        device=device_spec(raw["device"], f"{where}: device"), platform=platform,
        virtual=bool(raw.get("virtual", False)) if virtual is None else virtual,
        name=str(raw.get("name", path.stem)), hosts=hosts, distributed=distributed,
        source=where,
    )
    if mesh.virtual:
        return mesh
    if platform == "cpu":
        per_process = mesh.size // (distributed.num_processes if distributed else 1)
        set_cpu_device_count(per_process, f"mesh {mesh.name!r}{_from(where)}")
    elif (absent := gpu_absence()) is not None:
        raise MeshError(f"mesh {mesh.name!r}{_from(where)} is for {mesh.size} GPUs but no GPU "
                        f"is present ({absent}); {NO_GPU_ADVICE}")
    return mesh


def mesh_yaml(mesh: DeviceMesh, header: Sequence[str] = (),
              notes: Mapping[str, Sequence[str]] | None = None) -> str:
    """The mesh as a mesh file that ``load_mesh`` reads back equal (but for ``source``): the
    device's figures as a mapping, and every axis with its own link (``size``,
    ``bandwidth``, ``latency``), so measured figures need no intra/inter-host levels.
    ``header`` lines and ``notes[axis]`` lines become comments (above the file and the axis).
    A multi-process section is not written (the environment gives it: ``spmd launch``).

    >>> mesh = make_mesh({"data": 2}, bandwidth=25e9, latency=1e-5, virtual=True)
    >>> print(mesh_yaml(mesh, header=["made in a doctest"]), end="")  # doctest: +ELLIPSIS
    # made in a doctest
    name: mesh
    platform: cpu
    virtual: true
    device:
      name: cpu
      peak_flops_bf16: 5.0e+10
    ...
    axes:  # outer to inner, each with its own link
      data: {size: 2, bandwidth: 2.5e+10, latency: 1.0e-05}
    """
    notes = notes or {}
    dev = mesh.device
    lines = [f"# {line}".rstrip() for line in header]
    lines += [f"name: {_plain(mesh.name)}", f"platform: {mesh.platform}"]
    if mesh.virtual:
        lines.append("virtual: true")
    lines += ["device:", f"  name: {_plain(dev.name)}"]
    lines += [f"  {f.name}: " + _device_value(getattr(dev, f.name))
              for f in dataclasses.fields(dev) if f.name != "name"]
    lines += [f"hosts: {mesh.hosts}", f"devices_per_host: {mesh.size // mesh.hosts}",
              "axes:  # outer to inner, each with its own link"]
    for name, size in zip(mesh.axis_names, mesh.axis_sizes):
        lines += [f"  # {line}".rstrip() for line in notes.get(name, ())]
        link = mesh.links[name]
        lines.append(f"  {name}: {{size: {size}, bandwidth: {_figure(link.bandwidth)}, "
                     f"latency: {_figure(link.latency)}}}")
    return "\n".join(lines) + "\n"


def _device_value(value: Any) -> str:
    """A device field as a mesh file writes it: text plain, figures as ``_figure``, a curve
    as a flow list of pairs, named rates (``op_rates``) as a flow mapping."""
    if isinstance(value, str):
        return _plain(value)
    if isinstance(value, tuple) and value and isinstance(value[0][0], str):
        return "{" + ", ".join(f"{_plain(k)}: {_figure(v)}" for k, v in value) + "}"
    if isinstance(value, tuple):
        return "[" + ", ".join(f"[{_figure(a)}, {_figure(b)}]" for a, b in value) + "]"
    return _figure(value)


def _figure(value: float) -> str:
    """A figure in the bundled files' notation (``3.0e+11``), in as few digits as read back
    exactly; integers (memory bytes) as they are."""
    if isinstance(value, int):
        return str(value)
    return np.format_float_scientific(value, unique=True, trim="0")


def _plain(text: str) -> str:
    """``text`` as a YAML scalar that reads back as this string: plain where it does, else
    quoted (a JSON string is a YAML one)."""
    return text if yaml.safe_load(text) == text else json.dumps(text)


def _distributed(raw: Any, where: str) -> DistributedConfig | None:
    """The multi-process section, or the environment variables SPMD_COORDINATOR,
    SPMD_NUM_PROCESSES and SPMD_PROCESS_ID (these win, so one file serves every process)."""
    raw = dict(raw or {})
    if not isinstance(raw, dict) or set(raw) - _DIST_KEYS:
        raise MeshError(f"{where}: distributed: valid keys are {sorted(_DIST_KEYS)}")
    env = {"coordinator": "SPMD_COORDINATOR", "num_processes": "SPMD_NUM_PROCESSES",
           "process_id": "SPMD_PROCESS_ID"}
    for key, var in env.items():
        if os.environ.get(var):
            raw[key] = os.environ[var]
    if not raw or int(raw.get("num_processes", 1)) == 1:
        return None
    missing = sorted(_DIST_KEYS - set(raw))
    if missing:
        raise MeshError(f"{where}: distributed: missing {missing} (or set "
                        f"{', '.join(env[m] for m in missing)})")
    num = _number(raw["num_processes"], f"{where}: distributed.num_processes", int)
    pid = _number(raw["process_id"], f"{where}: distributed.process_id", int, positive=False)
    if not 0 <= pid < num:
        raise MeshError(f"{where}: distributed.process_id {pid} not in [0, {num})")
    return DistributedConfig(str(raw["coordinator"]), num, pid)


def make_mesh(
    axes: Mapping[str, int],
    bandwidth: float | Mapping[str, float] = 100e9,
    latency: float | Mapping[str, float] = 5e-6,
    device: str | Mapping[str, Any] | DeviceSpec = "cpu",
    *,
    platform: str | None = None,
    virtual: bool = False,
    name: str = "mesh",
) -> DeviceMesh:
    """Build a mesh in code; per-axis ``bandwidth`` (bytes/s) and ``latency`` (s) or one for all.

    Unlike ``load_mesh`` it leaves jax's CPU device count alone and asks for no devices: cost
    code prices a GPU mesh anywhere. A mesh that is not virtual is held to its devices where
    a plan first needs them (``sharding_mesh``).
    """
    if not axes:
        raise MeshError("make_mesh: axes must name at least one axis, e.g. {'data': 8}")
    names = tuple(str(n) for n in axes)
    sizes = tuple(_number(s, f"make_mesh: axes[{n!r}]", int) for n, s in axes.items())

    def per_axis(value: float | Mapping[str, float], what: str) -> dict[str, float]:
        if isinstance(value, Mapping):
            missing = [n for n in names if n not in value]
            extra = [n for n in value if n not in names]
            if missing or extra:
                raise MeshError(f"make_mesh: {what} must give every axis {list(names)}; "
                                f"missing {missing}, unknown {extra}")
            return {n: float(value[n]) for n in names}
        return {n: float(value) for n in names}

    bws, lats = per_axis(bandwidth, "bandwidth"), per_axis(latency, "latency")
    spec = device_spec(device, "make_mesh: device")
    return DeviceMesh(
        axis_names=names, axis_sizes=sizes,
        links={n: Link(bws[n], lats[n]) for n in names}, device=spec,
        platform=platform or ("cpu" if spec.name == "cpu" else "gpu"), virtual=virtual, name=name,
    )
