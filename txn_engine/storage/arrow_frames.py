"""Spark and Arrow side by side: the Arrow types of the table contract's Spark schemas, and small
Spark frames built from Arrow in the driver."""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import pyarrow as pa
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import types as T


_ARROW_TYPES = {
    T.StringType: pa.string(),
    T.LongType: pa.int64(),
    T.IntegerType: pa.int32(),
    T.BooleanType: pa.bool_(),
    T.BinaryType: pa.binary(),
    T.TimestampType: pa.timestamp("us", tz="UTC"),
    T.DoubleType: pa.float64(),
    T.FloatType: pa.float32(),
    T.ShortType: pa.int16(),
    T.ByteType: pa.int8(),
    T.DateType: pa.date32(),
}


def arrow_type(data_type: T.DataType) -> pa.DataType:
    if isinstance(data_type, T.ArrayType):
        return pa.list_(arrow_type(data_type.elementType))
    if isinstance(data_type, T.MapType):
        return pa.map_(arrow_type(data_type.keyType), arrow_type(data_type.valueType))
    if isinstance(data_type, T.DecimalType):
        return pa.decimal128(data_type.precision, data_type.scale)
    if isinstance(data_type, T.StructType):
        return pa.struct([arrow_field(f) for f in data_type.fields])
    return _ARROW_TYPES[type(data_type)]


def arrow_field(field: T.StructField) -> pa.Field:
    return pa.field(field.name, arrow_type(field.dataType), field.nullable)


def arrow_schema(schema: T.StructType) -> pa.Schema:
    """The Arrow schema of a table contract schema (schema.py stays the one definition)."""
    return pa.schema([arrow_field(f) for f in schema.fields])


def local_frame(spark: SparkSession, rows: Sequence[Sequence[Any] | Mapping[str, Any]] | pa.Table,
                schema: T.StructType | str) -> DataFrame:
    """A DataFrame of rows made in the driver (tuples in `schema`'s order, dicts, or an Arrow table), sent to Spark
    as Arrow: `createDataFrame` of a Python list makes the executors start Python workers to
    unpickle them."""
    struct = schema if isinstance(schema, T.StructType) else T.StructType.fromDDL(schema)
    if isinstance(rows, pa.Table):
        return spark.createDataFrame(rows.select(struct.fieldNames()).cast(arrow_schema(struct)), struct)
    dicts = [r if isinstance(r, Mapping) else dict(zip(struct.fieldNames(), r)) for r in rows]
    return spark.createDataFrame(pa.Table.from_pylist(dicts, arrow_schema(struct)), struct)
